"""The training configs every kind shares: `TrainConfig` and its sections (docs/architecture.md,
"Config").

A kind's trainer subclasses `TrainConfig` with its drafter section and builds it with
`parse_cli` (specdraft/config.py, the config engine: YAML files, key=value overrides, named
errors, --help from the comments above the fields).
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from specdraft.config import ConfigError, check_choices, choice
from specdraft.core import DecodeConfig, owner_of
from specdraft.data.data_config import DataConfig
from specdraft.drafters.base import drafter_kinds, kinds_own_settings
from specdraft.losses import DEFAULT_CHUNK_TOKENS, check_chunk_tokens
from specdraft.measuring.tuning import SEARCH_ORDER as TUNABLE
from specdraft.measuring.tuning import tunable
from specdraft.precision import resolve_precision
from specdraft.targets.frozen import SHARDINGS

# The resolved config of a run, in output_dir and in every checkpoint folder.
CONFIG_FILENAME = "train_config.yaml"


class SetupError(ValueError):
    """A run that cannot start: missing data, a bad target, sizes its drafter refuses. An entry
    script says it in one line and exits 2; an error once training runs keeps its traceback."""


@contextlib.contextmanager
def setting_up() -> Iterator[None]:
    """Around a run's setup, before training: a ValueError or OSError becomes a SetupError."""
    try:
        yield
    except (ValueError, OSError) as e:
        raise SetupError(str(e)) from e


def _at_least(config, lows: dict[str, int], prefix: str = "") -> None:
    """A ConfigError naming the first key of `lows` whose value is below its minimum."""
    for key, low in lows.items():
        if getattr(config, key) < low:
            got = getattr(config, key)
            raise ConfigError(f"{prefix}{key} must be >= {low}; got {got}", key=prefix + key)


@dataclass
class LoopEvalConfig:
    """After training: the saved drafter measured in the inference loop against plain decoding
    (measuring/measure.py), written to output_dir/eval_loop.json beside the simulated tau."""

    # Run the measurement at the end of training (it decodes every prompt twice).
    enabled: bool = True
    # auto: the demo's held-out prompts when data.path is demo, else the prompt part of the
    # held-out split; or mt-bench | humaneval | stdlib-requests | demo | eval | hub:DATASET |
    # a .txt/.json/.jsonl file of prompts (measuring/measure.py, read_requests).
    prompts: str = "auto"
    # Requests decoded, every turn of each, by each of the drafter and plain decoding (a named
    # set's taken round-robin over its categories: 8 is one of each of MT-Bench's).
    num_prompts: int = 8
    # New tokens per prompt (fewer if EOS comes first).
    max_new_tokens: int = 128
    # 0 is greedy (output must equal plain decoding's); above 0, seeded lossless sampling.
    temperature: float = 0.0
    # Trees (decode.tree_top_k > 1): first decode the first tune_prompts prompts with each of
    # these tree budgets and save the fastest (tokens/s on this machine) as the drafter's
    # tree_budget; empty: keep decode.tree_budget. How many nodes pay off depends on the
    # hardware: a CPU verifies 16 tokens at ~2 plain steps' cost, a GPU 64 at about one.
    tune_budgets: list[int] = field(default_factory=list)
    # Decoding settings chosen by measured tokens/s before the measurement, searched over
    # scripts/tune.py's values and saved as the drafter's defaults: any of exit_layer,
    # tree_top_k, tree_budget, gamma, stop_below, draft_weights, lookup_ngram, lookup_gamma
    # (e.g. LayerSkip's [exit_layer, gamma]); empty: keep the decode section's.
    tune: list[str] = field(default_factory=list)
    # Prompts each budget or setting is measured on.
    tune_prompts: int = 6
    # Passes of the search over `tune`: a later pass races a setting again where another one
    # changed since its round (they interact: a shallow LayerSkip exit wants a short draft).
    tune_passes: int = 2
    # The target's precision in the measurement. auto: as its checkpoint was saved (how
    # evaluate.py and a user decode it by default), whatever training loaded it in: the demo
    # target trains in bf16 on a CPU with native bf16 but decodes fastest in fp32 (one-token
    # steps gain nothing from bf16 there; BENCHMARKS.md, "Precision"). Or float32 | bfloat16 |
    # float16; native: bf16 where the device computes it natively (AVX-512 BF16 or AMX CPUs,
    # most GPUs), else fp32 (a real target decodes fastest so: BENCHMARKS.md, "Real targets").
    dtype: str = choice("auto", "native", "float32", "bfloat16", "float16")
    # CPU threads for the measurement; 0: the count at which a one-token step of the target runs
    # fastest on the machine as it is (measuring/measure.py, choose_threads; --threads 0 of the
    # scripts).
    # (`accelerate launch` pins a lone CPU process to 1 thread for training; decoding speedups
    # differ by thread count, so the measurement states the count it ran with.)
    threads: int = 0

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ConfigError(
                f"eval_loop.threads must be >= 0 (0: the fastest now); got {self.threads}",
                key="eval_loop.threads",
            )
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.tune_budgets):
            raise ConfigError(
                f"eval_loop.tune_budgets must be integers >= 1; got {list(self.tune_budgets)}",
                key="eval_loop.tune_budgets",
            )
        unknown = [k for k in self.tune if k not in TUNABLE and owner_of(k) is None]
        if unknown:
            raise ConfigError(
                f"eval_loop.tune {unknown}: each must be one of {', '.join(TUNABLE)}, or a "
                f"setting of the drafter's own kind ({', '.join(kinds_own_settings())})",
                key="eval_loop.tune",
            )
        keys = ("num_prompts", "max_new_tokens", "tune_prompts", "tune_passes")
        _at_least(self, dict.fromkeys(keys, 1), prefix="eval_loop.")
        if self.temperature < 0:
            raise ConfigError("eval_loop.temperature must be >= 0", key="eval_loop.temperature")


@dataclass
class TrainConfig:
    """The keys every drafter kind shares (docs/architecture.md, "Common config keys and outputs").

    A drafter kind subclasses it, names its kind and adds its own section:

        @dataclass
        class EagleTrainConfig(TrainConfig):
            kind: ClassVar[str] = "eagle"
            drafter: EagleConfig = field(default_factory=EagleConfig)

    Building one (directly, or through `load_config`) validates choices and ranges and resolves
    the defaults that depend on other keys (`output_dir`, `run_name`).
    """

    # The drafter kind this config trains. A class attribute, not a key: a file cannot make the
    # eagle script train something else, and the kind picks the default output_dir.
    kind: ClassVar[str] = "base"

    # The target model: "demo" (the small model built on first use), a local folder or a hub id.
    target: str = "demo"
    # dtype the frozen target is loaded in; auto follows mixed_precision (bf16 -> bfloat16,
    # fp16 -> float16, no -> float32) so CPU runs stay fp32 and GPU runs need one key.
    dtype: str = choice("auto", "float32", "bfloat16", "float16")
    # A frozen target too big for one device: zero3 partitions it over the processes (DeepSpeed
    # ZeRO-3 inference: each holds 1/N of it and gathers a module's weights for its forward) so
    # that the drafter trains online against it; none loads it whole on every process. For the
    # kinds whose target stays frozen (eagle, medusa without LoRA, distill); the drafter's own
    # optimizer and data parallelism are the launcher's business as always.
    target_sharding: str = choice(*SHARDINGS)
    # Training data: source, conversation format, lengths and the held-out split.
    data: DataConfig = field(default_factory=DataConfig)
    # Where checkpoint-<step>/, best/, final/ and train_config.yaml go; None: runs/<kind>-demo.
    output_dir: str | None = None
    # Length of the run in optimizer steps (one step = grad_accum micro-batches).
    max_steps: int = 2000
    # Sequences per device per forward pass; lower it first when memory runs out.
    micro_batch_size: int = 8
    # Micro-batches per optimizer step: effective batch = micro_batch_size * grad_accum * devices.
    grad_accum: int = 1
    # Peak learning rate (AdamW), reached at the end of warmup.
    lr: float = 3e-4
    # AdamW decoupled weight decay; 0 leaves the weights unregularized.
    weight_decay: float = 0.0
    # AdamW first-moment coefficient.
    adam_beta1: float = 0.9
    # AdamW second-moment coefficient; below the usual 0.999 so short runs adapt faster.
    adam_beta2: float = 0.95
    # Steps of linear warmup from 0 to lr, before the schedule below starts.
    warmup_steps: int = 100
    # Decay after warmup, a pure function of the step: cosine | linear | constant.
    lr_schedule: str = choice("cosine", "linear", "constant")
    # Floor of the decay as a fraction of lr (cosine and linear end at lr * min_lr_ratio).
    min_lr_ratio: float = 0.1
    # Clip the global gradient norm to this; 0 disables clipping.
    max_grad_norm: float = 1.0
    # Seeds model init, data order and dropout; the same seed reproduces a run.
    seed: int = 0
    # Steps between loss/lr lines on the console and the tracker.
    log_every: int = 10
    # Steps between evaluations on the held-out split (loss and simulated tau); 0 disables.
    eval_every: int = 500
    # What held-out evaluation (its loss, its simulated tau, best/) runs on: served (the target's
    # own continuations of the eval_loop prompts, eval_loop.max_new_tokens long, greedy or
    # sampled at eval_loop.temperature as the drafter is served, generated once and cached under
    # SPECDRAFT_HOME/continuations; at temperature 0 the simulated tau there is the loop's own) |
    # corpus (the held-out split's text) | auto (served where the run measures the drafter in the
    # loop, eval_loop.enabled, and can decode with the target: not from a hidden_cache, not
    # sharded).
    eval_on: str = choice("auto", "served", "corpus")
    # Held-out micro-batches per process per evaluation (the same examples for any process count);
    # 0 uses the whole held-out split.
    eval_batches: int = 50
    # Steps between resumable checkpoint-<step>/ folders; 0 saves only best/ and final/.
    save_every: int = 500
    # checkpoint-<step>/ folders kept, oldest deleted first (best/ and final/ stay); 0 keeps all.
    keep_last: int = 2
    # Experiment tracker: none | wandb | tensorboard (console progress is always on).
    report_to: str = choice("none", "wandb", "tensorboard")
    # W&B project the run is logged to (report_to=wandb only).
    wandb_project: str = "specdraft"
    # Name of the run in the tracker; None: the name of output_dir.
    run_name: str | None = None
    # Free-form labels for the tracker, e.g. tags=[demo,ablation].
    tags: list[str] = field(default_factory=list)
    # None: start fresh; "latest": the newest complete checkpoint in output_dir; or a
    # checkpoint-<step> folder.
    resume_from: str | None = None
    # Positions whose vocabulary-wide logits a loss computes at once: the LM head runs inside
    # the loss over this many positions at a time and again in the backward pass, so no
    # (tokens, vocab) float32 tensor exists for a whole batch (specdraft/losses.py). 0 or null:
    # the whole micro-batch at once (fastest, and the most memory: 4.2 GB per float32 copy at
    # a 128k vocabulary and 8k tokens). The loss is the same either way.
    loss_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS
    # Autocast precision of training (accelerate's values): auto | no | bf16 | fp16. auto: bf16
    # where the device has native bf16 (GPUs that support it; CPUs with AVX-512 BF16 or AMX,
    # where it trained 1.6-2.5x faster: git history of BENCHMARKS.md, "Precision"), else no
    # (fp32). The saved train_config.yaml holds the precision the run used.
    mixed_precision: str = choice("auto", "no", "bf16", "fp16")
    # Threads per process when training on a CPU; 0: OMP_NUM_THREADS where you set it for a plain
    # `python` run, else the physical cores this process may use divided by the processes on this
    # machine (what `accelerate launch --cpu` picks). Plain `accelerate launch` on a machine
    # without a GPU gives every process OMP_NUM_THREADS=1, which on the demo's 2 cores trains at
    # 0.57x the speed (demo target v1; git history of BENCHMARKS.md); under accelerate, set
    # cpu_threads to choose.
    cpu_threads: int = 0
    # How the drafter drafts when served: saved in its checkpoint as its decoding defaults,
    # measured with at the end of training, and the depth (gamma) of the simulated tau.
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    # After training: the saved drafter's measured tau and speedup in the inference loop.
    eval_loop: LoopEvalConfig = field(default_factory=LoopEvalConfig)
    # The simulated tau that picks best/ and is reported beside the measured one: greedy (what
    # greedy verification accepts: the loop's walk on greedy continuations, else top-1
    # agreement along the unroll) | sampled (what lossless sampling accepts: the walk in
    # expectation on sampled continuations, else sum min(p, q) per depth as a chain) | auto
    # (greedy when the drafter is measured greedy, eval_loop.temperature 0; else sampled).
    best_by: str = choice("auto", "greedy", "sampled")
    # A later evaluation whose simulated tau is within this fraction of the best so far
    # replaces best/: the held-out prompts cannot rank checkpoints closer than their noise (on
    # the demo target 20 prompts ranked two EAGLE-3 checkpoints 0.8% one way (3.59 against 3.56)
    # and 40 others 2.1% the other; BENCHMARKS.md, "Which checkpoint best/ keeps"), and within it the
    # checkpoint trained longer is the better bet. 0: only a higher one replaces it.
    best_within: float = 0.02

    def served_tau_key(self) -> str:
        """The evaluation's simulated tau that matches how the drafter is served (best_by)."""
        greedy = self.best_by == "greedy" or (
            self.best_by == "auto" and self.eval_loop.temperature == 0
        )
        return "tau_greedy" if greedy else "tau"

    def target_dtype(self) -> str:
        """The dtype the target loads in: `dtype`, or for auto the one mixed_precision implies."""
        if self.dtype != "auto":
            return self.dtype
        return {"bf16": "bfloat16", "fp16": "float16"}.get(self.mixed_precision, "float32")

    def __post_init__(self) -> None:
        # OmegaConf.to_object calls this too, so files, overrides and code are held to one standard.
        check_choices(self, prefix="")
        lows = {
            "max_steps": 1, "micro_batch_size": 1, "grad_accum": 1, "weight_decay": 0,
            "warmup_steps": 0, "max_grad_norm": 0, "log_every": 1, "eval_every": 0,
            "eval_batches": 0, "save_every": 0, "keep_last": 0, "cpu_threads": 0,
        }  # fmt: skip
        _at_least(self, lows)
        try:
            self.loss_chunk_tokens = check_chunk_tokens(self.loss_chunk_tokens)
        except ValueError as e:
            raise ConfigError(str(e), key="loss_chunk_tokens") from None
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0; got {self.lr}", key="lr")
        for key in ("min_lr_ratio", "adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"{key} must be in [0, 1]; got {getattr(self, key)}", key=key)
        if not 0 <= self.best_within < 1:
            raise ConfigError(
                f"best_within must be in [0, 1) (a fraction of the best simulated tau, 0.02 for "
                f"2%); got {self.best_within}", key="best_within",
            )  # fmt: skip
        self._check_kind_rules()
        tune = self.eval_loop.tune
        if "lookup_gamma" in tune and "lookup_ngram" not in tune and not self.decode.lookup_ngram:
            raise ConfigError(
                "eval_loop.tune has lookup_gamma, the length of copies, but nothing copies: "
                "decode.lookup_ngram is 0 and not tuned. Add lookup_ngram to eval_loop.tune, or "
                "set decode.lookup_ngram (e.g. 3)",
                key="eval_loop.tune",
            )
        if self.mixed_precision == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            bf16 = resolve_precision("auto", device, "training") == "bf16"
            self.mixed_precision = "bf16" if bf16 else "no"
        if self.output_dir is None:
            self.output_dir = f"runs/{self.kind}-demo"
        if self.run_name is None:
            self.run_name = Path(self.output_dir).name

    def _check_kind_rules(self) -> None:
        """The drafter kind's own rules (drafters/base.py): no other kind's decoding setting in
        decode or eval_loop.tune, data.pack only where the kind's loss keeps a packed row's
        documents apart, and target_sharding only where the kind keeps the target frozen. A config of no registered kind (the base, a test's) has none."""
        cls = drafter_kinds().get(self.kind)
        if cls is None:
            return
        try:  # the kind's own settings class, whatever decode was built as
            self.decode = cls.decode_settings(self.decode)
        except ValueError as e:
            raise ConfigError(f"decode: {e}", key="decode") from None
        for key in self.eval_loop.tune:
            owner = owner_of(key)
            if key not in tunable(cls.decode_class) and owner is not None:
                raise ConfigError(
                    f"eval_loop.tune has {key}, {owner.owner}'s decoding setting, and this trains "
                    f"a {cls.title or cls.kind} drafter: leave it out",
                    key="eval_loop.tune",
                )
        if self.data.pack:
            why = cls.packing_problem(getattr(self, "drafter", None))
            if why is not None:
                raise ConfigError(f"data.pack=true: {why}; set data.pack=false", key="data.pack")
        if self.target_sharding != "none":
            why = cls.sharding_problem(getattr(self, "drafter", None))
            if why is not None:
                raise ConfigError(
                    f"target_sharding={self.target_sharding} is for a frozen target; {why}",
                    key="target_sharding",
                )
