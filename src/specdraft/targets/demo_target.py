"""The demo target: a small Llama trained on the standard library's Python source.

`load_target("demo")` calls `ensure_demo_target`, which builds it on first use;
`scripts/build_demo_target.py` is the command line (variants, budgets, --report).

The result is a standard HF model folder (AutoModelForCausalLM / AutoTokenizer load it offline)
cached under $SPECDRAFT_HOME/demo-target/ (default ~/.cache/specdraft). The folder name carries a
hash of every build setting and of the Python version whose stdlib is the corpus, so changing
either builds anew and a stale cache is never reused. A build is deterministic for its seed.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

from specdraft.cache import build_once, specdraft_home
from specdraft.core import loops
from specdraft.data.stdlib_corpus import END, build_demo_tokenizer, demo_corpus_texts, demo_prompts
from specdraft.precision import resolve_precision

# Bump when a change to this file changes what a build produces for the same settings.
BUILD_VERSION = 3  # 3: fp32 builds orthogonalize Muon's updates in fp32; the repetition phase
COMPLETE_MARKER = "build_info.json"


@dataclass(frozen=True)
class DemoSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    corpus_files: int  # use only the first N corpus files for tokenizer and training (0: all)
    seed: int = 0
    # Training autocast: bf16 where the CPU has it natively (resolve_spec turns "auto" into what
    # this machine runs, so the cache folder's hash names the precision actually used), else fp32.
    precision: str = "auto"
    # muon: Muon (torch.optim.Muon's update, RMS matched to AdamW's) for the decoder layers'
    # matrices and AdamW for embeddings and norms; at the same tokens it learned far faster here
    # (measured while choosing demo target v2; git history of BENCHMARKS.md). adamw: AdamW for
    # everything (the tiny variant, v1).
    optimizer: str = "muon"
    # The pseudo-repetition penalty (DITTO, Xu et al. 2022, "Learning to Break the Loop"): after
    # the likelihood steps, `repeat_steps` more steps at a constant `repeat_lr` (fresh optimizers)
    # each add `batch_size` rows that repeat a line (`repeat_unit`) of a training block. At every
    # token of a repetition the model is trained toward `repeat_decay` times its probability of
    # that token one repetition earlier, so a repeated line grows less likely instead of more.
    # Without it a small model's greedy output falls into loops (BENCHMARKS.md, "Demo target,
    # build 3").
    repeat_steps: int = 0
    repeat_lr: float = 8e-4
    repeat_decay: float = 0.5
    repeat_unit: str = "lines"  # lines: whole lines where they fit; tokens: spans of 2-24 tokens
    # 0: the phase above, after the likelihood steps (build 3). r > 0: no extra steps; instead r of
    # the batch_size rows of each of the last `repeat_steps` likelihood steps are pseudo-repetitive,
    # trained at the schedule's lr by the same optimizers (repeat_lr unused). A cheaper build that
    # sees r * repeat_steps fewer training blocks (git history of BENCHMARKS.md, "Demo target,
    # build 3").
    repeat_rows: int = 0


# Settings added after build 3 enter the cache folder's hash only when they differ from these
# values, so that adding a setting does not orphan the targets (and drafters) already built.
LATER_SETTINGS = {"repeat_rows": 0}


SPECS = {
    "default": DemoSpec(
        vocab_size=4096, hidden_size=256, num_layers=8, num_heads=4, intermediate_size=688,
        seq_len=512, batch_size=8, steps=500, lr=4e-3, warmup_steps=20, corpus_files=0,
        repeat_steps=120,
    ),
    "tiny": DemoSpec(
        vocab_size=384, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
        seq_len=64, batch_size=4, steps=25, lr=3e-3, warmup_steps=2, corpus_files=40,
        optimizer="adamw",
    ),
}  # fmt: skip
BUDGETS = {"default": 1, "long": 3}


def resolve_spec(
    variant: str = "default", budget: str = "default", seed: int = 0, overrides: dict | None = None
) -> DemoSpec:
    """The build settings of a variant, scaled by a budget, with optional field overrides."""
    if variant not in SPECS:
        raise ValueError(f"unknown demo variant {variant!r}; choose one of {sorted(SPECS)}")
    if budget not in BUDGETS:
        raise ValueError(f"unknown build budget {budget!r}; choose one of {sorted(BUDGETS)}")
    spec = SPECS[variant]
    spec = replace(spec, steps=spec.steps * BUDGETS[budget], seed=seed)
    unknown = sorted(set(overrides or {}) - set(asdict(spec)))
    if unknown:
        raise ValueError(f"unknown demo build setting(s) {unknown}; valid: {sorted(asdict(spec))}")
    spec = replace(spec, **(overrides or {}))
    if spec.optimizer not in ("muon", "adamw"):
        raise ValueError(f"demo build optimizer {spec.optimizer!r}: choose muon or adamw")
    if spec.repeat_steps < 0 or not 0 < spec.repeat_decay < 1 or spec.repeat_lr <= 0:
        raise ValueError(
            f"demo build repetition settings repeat_steps={spec.repeat_steps}, repeat_decay="
            f"{spec.repeat_decay}, repeat_lr={spec.repeat_lr}: need repeat_steps >= 0, "
            "0 < repeat_decay < 1 and repeat_lr > 0"
        )
    if not 0 <= spec.repeat_rows < spec.batch_size or (
        spec.repeat_rows and not 0 < spec.repeat_steps <= spec.steps
    ):
        raise ValueError(
            f"demo build repeat_rows={spec.repeat_rows} with batch_size={spec.batch_size}, "
            f"repeat_steps={spec.repeat_steps} and steps={spec.steps}: need 0 <= repeat_rows < "
            "batch_size, and 0 < repeat_steps <= steps when repeat_rows > 0 (the rows go into "
            "the last repeat_steps likelihood steps)"
        )
    if spec.repeat_unit not in ("tokens", "lines"):
        raise ValueError(f"demo build repeat_unit {spec.repeat_unit!r}: choose tokens or lines")
    if spec.precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"demo build precision {spec.precision!r}: choose auto, bf16 or fp32")
    return replace(spec, precision=resolve_precision(spec.precision, "cpu", "the demo build"))


def demo_target_dir(spec: DemoSpec, variant: str) -> Path:
    settings = asdict(spec)
    for name, value in LATER_SETTINGS.items():
        if settings[name] == value:
            del settings[name]
    key = json.dumps(
        {"spec": settings, "python": platform.python_version(), "build": BUILD_VERSION},
        sort_keys=True,
    )
    return (
        specdraft_home()
        / "demo-target"
        / f"{variant}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    )


def ensure_demo_target(
    variant: str = "default",
    budget: str = "default",
    seed: int = 0,
    force: bool = False,
    overrides: dict | None = None,
) -> Path:
    """The cached demo target's folder, built first if missing (or if `force`). Safe to call from
    several processes at once: one builds under a file lock, the others wait and reuse it."""
    spec = resolve_spec(variant, budget, seed, overrides)
    out = demo_target_dir(spec, variant)
    # `build` looked up at call time: tests stand in for it
    return build_once(
        out, lambda tmp: build(spec, tmp), f"the demo target ({variant})", COMPLETE_MARKER,
        force=force,
    )  # fmt: skip


def _lr_at(step: int, spec: DemoSpec) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizers(model: LlamaForCausalLM, spec: DemoSpec) -> list[torch.optim.Optimizer]:
    """Muon for the decoder layers' matrices and AdamW for the rest, or AdamW for all; weight
    decay 0.1 on matrices, none on embeddings and norms."""
    named = list(model.named_parameters())
    matrices = [p for n, p in named if p.dim() >= 2 and "embed_tokens" not in n]
    embeddings = [p for n, p in named if p.dim() >= 2 and "embed_tokens" in n]
    vectors = [p for n, p in named if p.dim() < 2]
    adamw = dict(lr=spec.lr, betas=(0.9, 0.95))
    if spec.optimizer == "adamw":
        groups = [{"params": matrices + embeddings, "weight_decay": 0.1}]
        return [torch.optim.AdamW([*groups, {"params": vectors, "weight_decay": 0.0}], **adamw)]
    # The same lr and decay as AdamW, per the RMS matching; orthogonalized in bf16 only where
    # the CPU computes bf16 natively.
    ns_dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32
    muon = Muon(matrices, lr=spec.lr, weight_decay=0.1, ns_dtype=ns_dtype)
    rest = torch.optim.AdamW(
        [{"params": embeddings, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        **adamw,
    )
    return [muon, rest]


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update with `adjust_lr_fn="match_rms_adamw"` (Nesterov momentum 0.95,
    five Newton-Schulz steps, lr scaled so the update's RMS matches AdamW's, decoupled weight
    decay), with the orthogonalization in `ns_dtype` rather than always in bf16. On a CPU without
    native bf16, torch's emulated-bf16 Newton-Schulz took 89% of a demo build step; in fp32 it is
    a small share. With `ns_dtype=torch.bfloat16` the updates are bit-identical to torch's (tested).
    """

    def __init__(self, params, lr: float, weight_decay: float, ns_dtype: torch.dtype) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": 0.95})
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # closure: the Optimizer signature; unused
        for group in self.param_groups:
            lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(param.grad, 1 - momentum)
                update = _orthogonalize(param.grad.lerp(buffer, momentum), self.ns_dtype)
                param.mul_(1 - lr * decay)
                param.add_(update, alpha=-(lr * (0.2 * math.sqrt(max(param.shape[:2])))))


def _orthogonalize(matrix: torch.Tensor, dtype: torch.dtype, steps: int = 5) -> torch.Tensor:
    """The quintic Newton-Schulz iteration toward the nearest semi-orthogonal matrix (Muon's
    coefficients), computed in `dtype`."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix.to(dtype, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=1e-7))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _blocks(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenize, join documents with EOS and cut into (n_blocks, seq_len + 1) rows."""
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    n = (len(ids) - 1) // seq_len
    flat = torch.tensor(ids[: n * seq_len + 1])
    return flat.unfold(0, seq_len + 1, seq_len)  # blocks overlap by one token: input + label


def build(spec: DemoSpec, out: Path) -> dict:
    """Train tokenizer and model for `spec` and save both to `out`; returns the build info."""
    start = time.time()
    torch.manual_seed(spec.seed)
    train_texts = demo_corpus_texts("train")[: spec.corpus_files or None]  # 0: all
    tokenizer = build_demo_tokenizer(train_texts, spec.vocab_size)

    train_blocks = _blocks(train_texts, tokenizer, spec.seq_len)  # (n, seq_len + 1)
    eval_blocks = _blocks(demo_corpus_texts("heldout"), tokenizer, spec.seq_len)[:64]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    optimizers = _optimizers(model, spec)
    order = torch.randperm(len(train_blocks), generator=torch.Generator().manual_seed(spec.seed))
    model.train()
    log_every = max(1, spec.steps // 20)
    repetition = _Repetition(tokenizer, spec, train_blocks) if spec.repeat_steps else None
    in_place_from = spec.steps - spec.repeat_steps if spec.repeat_rows else spec.steps
    for step in range(spec.steps):
        for group in (g for opt in optimizers for g in opt.param_groups):
            group["lr"] = _lr_at(step, spec)
        rows = spec.batch_size - (spec.repeat_rows if step >= in_place_from else 0)
        idx = order[(torch.arange(rows) + step * spec.batch_size) % len(order)]
        batch = train_blocks[idx]
        penalty = None
        if repetition is not None and rows < spec.batch_size:
            loss, penalty = repetition.loss(model, batch, spec.repeat_rows)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.precision == "bf16"):
                loss = model(input_ids=batch, labels=batch).loss  # HF shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == spec.steps - 1:
            likelihood = loss if penalty is None else loss - penalty
            extra = "" if penalty is None else f" penalty {penalty.item():.4f}"
            print(
                f"[specdraft] demo target step {step + 1}/{spec.steps} loss "
                f"{likelihood.item():.3f}{extra} ({time.time() - start:.0f}s)",
                file=sys.stderr,
            )
    if repetition is not None and not spec.repeat_rows:
        _penalize_repetition(model, repetition, spec, train_blocks, order, start)
    model.eval()
    heldout_loss = evaluate_loss(model, eval_blocks)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    extra_steps = 0 if spec.repeat_rows else spec.repeat_steps
    info = {
        "spec": asdict(spec),
        "python": platform.python_version(),
        "build_version": BUILD_VERSION,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens_seen": (spec.steps + extra_steps) * spec.batch_size * spec.seq_len,
        "repetition_rows_seen": spec.repeat_steps * (spec.repeat_rows or spec.batch_size),
        "train_tokens_available": int(train_blocks.numel()),
        "heldout_loss": heldout_loss,
        "build_seconds": round(time.time() - start, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (out / COMPLETE_MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return info


MAX_REPEATED_SPAN = 24  # tokens: the loop detector's longest period


def repetition_rows(
    blocks: torch.Tensor,
    n: int,
    generator: torch.Generator,
    line_ends: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n` pseudo-repetitive rows shaped like `blocks`' rows: a random block's first `start`
    tokens (0 to half a row), then a span of 2 to MAX_REPEATED_SPAN tokens that follows them
    in the block, repeated to the row's end. Returns (rows, starts, span lengths).

    With `line_ends` (a bool per token id: the token holds a newline) the span is a whole line
    where one fits: it starts after the first line end at or past the drawn start and runs
    through the next line end, the unit that a looping model repeats in code."""
    length = blocks.shape[1]
    picks = torch.randint(len(blocks), (n,), generator=generator)
    starts = torch.randint(0, length // 2 + 1, (n,), generator=generator)
    spans = torch.randint(2, MAX_REPEATED_SPAN + 1, (n,), generator=generator)
    if line_ends is not None:
        for i, block in enumerate(blocks[picks]):
            ends = torch.nonzero(line_ends[block]).squeeze(-1).tolist()
            after = [e for e in ends if e >= starts[i] - 1]  # a line starts at e + 1
            if len(after) >= 2 and 2 <= after[1] - after[0] <= MAX_REPEATED_SPAN:
                starts[i], spans[i] = after[0] + 1, after[1] - after[0]
    position = torch.arange(length)
    # Up to `start` the block itself; after it the span, cycled.
    source = torch.where(
        position < starts[:, None],
        position,
        starts[:, None] + (position - starts[:, None]) % spans[:, None],
    )
    return blocks[picks].gather(1, source), starts, spans


def repetition_penalty(
    logits: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    spans: torch.Tensor,
    decay: float,
) -> tuple[torch.Tensor, int]:
    """DITTO's loss, summed, and the number of tokens it scored. `logits` are the model's over
    `rows[:, :-1]`. A token of the span's k-th repetition (k >= 1) with probability p, whose copy
    one repetition earlier had probability q, costs -log(1 - |p - decay * q|), q held fixed: the
    optimum makes each repetition `decay` times as likely as the one before it."""
    probs = torch.log_softmax(logits.float(), -1).gather(-1, rows[:, 1:, None]).squeeze(-1).exp()
    position = torch.arange(rows.shape[1])[None, :]  # a token's index in its row
    earlier = position - spans[:, None]  # the same token one repetition before
    scored = (position >= (starts + spans)[:, None]) & (earlier >= 1)
    # probs[:, i] is the probability of rows[:, i + 1]: the token at index t is probs[:, t - 1].
    now = probs.gather(1, (position - 1).clamp(min=0).expand_as(scored))
    before = probs.gather(1, (earlier - 1).clamp(min=0)).detach()
    cost = -torch.log((1 - (now - decay * before).abs()).clamp(min=1e-6))
    return (cost * scored).sum(), int(scored.sum())


class _Repetition:
    """The pseudo-repetitive rows of a build (see DemoSpec.repeat_steps) and the loss of a step
    that carries them: its likelihood rows' mean cross-entropy plus the rows' mean penalty."""

    def __init__(self, tokenizer, spec: DemoSpec, blocks: torch.Tensor) -> None:
        self.spec, self.blocks = spec, blocks
        self.generator = torch.Generator().manual_seed(spec.seed + 1)
        self.line_ends = None
        if spec.repeat_unit == "lines":
            self.line_ends = torch.tensor(
                ["\n" in tokenizer.decode([i]) for i in range(len(tokenizer))]
            )

    def loss(
        self, model: LlamaForCausalLM, batch: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(likelihood + mean penalty, mean penalty) of `batch` plus `n` new repetitive rows, in
        one forward."""
        rows, starts, spans = repetition_rows(self.blocks, n, self.generator, self.line_ends)
        bf16 = self.spec.precision == "bf16"
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=torch.cat([batch, rows])[:, :-1]).logits
        likelihood = torch.nn.functional.cross_entropy(
            logits[: len(batch)].float().flatten(0, 1), batch[:, 1:].flatten()
        )
        penalty, scored = repetition_penalty(
            logits[len(batch) :], rows, starts, spans, self.spec.repeat_decay
        )
        penalty = penalty / max(scored, 1)
        return likelihood + penalty, penalty


def _penalize_repetition(
    model: LlamaForCausalLM,
    repetition: _Repetition,
    spec: DemoSpec,
    blocks: torch.Tensor,
    order: torch.Tensor,
    began: float,
) -> None:
    """The build's DITTO phase after the likelihood steps (see DemoSpec.repeat_steps): each step
    the next batch of the likelihood order plus as many pseudo-repetitive rows, one forward."""
    optimizers = _optimizers(model, replace(spec, lr=spec.repeat_lr))
    model.train()
    for i in range(spec.repeat_steps):
        step = spec.steps + i
        batch = blocks[order[(torch.arange(spec.batch_size) + step * spec.batch_size) % len(order)]]
        loss, penalty = repetition.loss(model, batch, spec.batch_size)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if i % max(1, spec.repeat_steps // 10) == 0 or i == spec.repeat_steps - 1:
            print(
                f"[specdraft] demo target repetition step {i + 1}/{spec.repeat_steps} loss "
                f"{(loss - penalty).item():.3f} penalty {penalty.item():.4f} "
                f"({time.time() - began:.0f}s)",
                file=sys.stderr,
            )


@torch.no_grad()
def evaluate_loss(model: LlamaForCausalLM, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over held-out blocks."""
    losses = [model(input_ids=b, labels=b).loss.item() for b in blocks.split(batch_size)]
    return round(sum(losses) / len(losses), 4)


@torch.no_grad()
def report(path: Path, num_prompts: int = 20, max_new_tokens: int = 128) -> dict:
    """Plain greedy decoding of held-out prompts: tokens/s and how often the output loops."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = demo_prompts(num_prompts)
    encoded = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    model.generate(encoded[0], max_new_tokens=8, do_sample=False)  # warm-up
    new_tokens, looping, seconds = 0, 0, 0.0
    samples = []
    for ids in encoded:
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        seconds += time.perf_counter() - t0
        gen = out[0, ids.shape[1] :].tolist()
        new_tokens += len(gen)
        looping += loops(gen)
        if len(samples) < 2:
            samples.append(tokenizer.decode(gen))
    return {
        "prompts": num_prompts,
        "max_new_tokens": max_new_tokens,
        "plain_greedy_tokens_per_s": round(new_tokens / seconds, 1),
        "looping_fraction": looping / num_prompts,
        "samples": samples,
    }
