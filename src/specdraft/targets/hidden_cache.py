"""The offline hidden-state cache: the target's hidden states of a data set, written once and read
while training an EAGLE head, so the target's forward leaves the training loop.

A cache folder holds

    manifest.json              format version, the target's fingerprint, the layer ids, dtype,
                               hidden size, one sha256 of the token ids per example, and the
                               finished shards (rewritten atomically after each one)
    shard-00000.safetensors    per example i of the shard: "<i>.input_ids" (seq,) and
                               "<i>.layer<l>" (seq, hidden) for each stored layer l

`write_cache` is the one writer (resumable: finished shards are kept, the rest is written anew) and
`HiddenStateCache` the one reader, which checks everything it reads: the fingerprint against the
target, the token ids against the training data, shapes, and that values are finite. A damaged
shard or a cache of another target is an error that says what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specdraft.attention import document_layout, target_inputs
from specdraft.core import TargetOutput, check_fingerprint

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class HiddenCacheError(ValueError):
    """A cache that cannot be used: another target, other data, a damaged or missing shard."""


def ids_hash(ids: Sequence[int]) -> str:
    return hashlib.sha256(
        torch.as_tensor(list(ids), dtype=torch.int64).numpy().tobytes()
    ).hexdigest()[:16]


# --- writing -------------------------------------------------------------------------------------


@torch.no_grad()
def write_cache(
    folder: str | Path,
    target,
    examples: Sequence,
    layers: Sequence[int],
    *,
    dtype: str = "bf16",
    shard_examples: int = 256,
    batch_size: int = 8,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run `target` over `examples` and store `layers` (resumable); returns the manifest.

    Rerunning with the same arguments continues after the last finished shard; different target,
    layers, dtype or examples are an error rather than a mixed cache.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if dtype not in DTYPES:
        raise HiddenCacheError(f"cache dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    layers = sorted(set(target.check_layer_ids(layers)))
    manifest = {
        "format_version": FORMAT_VERSION,
        "target_fingerprint": target.fingerprint,
        "layers": layers,
        "dtype": dtype,
        "hidden_size": target.hidden_size,
        "shard_examples": shard_examples,
        "examples": [ids_hash(e.input_ids) for e in examples],
        "shards": [],
    }
    path = folder / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        if {**old, "shards": None} != {**manifest, "shards": None}:
            raise HiddenCacheError(
                f"{folder} holds a cache of another target, layers, dtype or data; write to a new "
                "folder, or delete this one to start over"
            )
        manifest["shards"] = old["shards"]
    done = {s["file"] for s in manifest["shards"]}
    for start in range(0, len(examples), shard_examples):
        name = f"shard-{start // shard_examples:05d}.safetensors"
        if name in done and (folder / name).exists():
            continue
        tensors: dict[str, torch.Tensor] = {}
        chunk = examples[start : start + shard_examples]
        for b in range(0, len(chunk), batch_size):
            rows = chunk[b : b + batch_size]
            length = max(len(e.input_ids) for e in rows)
            ids = torch.zeros(len(rows), length, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, e in enumerate(rows):
                ids[r, : len(e.input_ids)] = torch.tensor(e.input_ids)
                mask[r, : len(e.input_ids)] = 1
            batch = {"attention_mask": mask}
            if any(getattr(e, "document_lengths", None) for e in rows):  # packed rows (data.pack)
                lengths = [getattr(e, "document_lengths", None) or [len(e.input_ids)] for e in rows]
                batch["document_ids"], batch["position_ids"] = document_layout(lengths, length)
            inputs = {
                k: v.to(target.device) for k, v in target_inputs(batch).items() if v is not None
            }
            out = target.forward(ids.to(target.device), **inputs, capture_layers=layers)
            for r, e in enumerate(rows):
                i, n = start + b + r, len(e.input_ids)
                tensors[f"{i}.input_ids"] = ids[r, :n].clone()
                for layer in layers:
                    h = out.hidden_states[layer][r, :n].to(DTYPES[dtype]).cpu()  # (seq, hidden)
                    tensors[f"{i}.layer{layer}"] = h.contiguous()
        tmp = folder / f".{name}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, folder / name)
        tokens = sum(len(e.input_ids) for e in chunk)
        manifest["shards"].append(
            {"file": name, "start": start, "count": len(chunk), "tokens": tokens}
        )
        _write_json(path, manifest)
        if progress:
            progress(f"{name}: {len(chunk)} examples, {tokens} tokens")
    _write_json(path, manifest)
    return manifest


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def bytes_per_token(folder: str | Path) -> float:
    """Bytes of shard files per cached token."""
    manifest = json.loads((Path(folder) / MANIFEST).read_text())
    size = sum((Path(folder) / s["file"]).stat().st_size for s in manifest["shards"])
    return size / max(1, sum(s["tokens"] for s in manifest["shards"]))


# --- reading -------------------------------------------------------------------------------------


class HiddenStateCache:
    """Read a cache written by `write_cache` for `target` and the training `examples`.

    Construction checks the manifest (complete, this target, these examples, the `layers` the
    head needs); each shard is checked when first read (readable, ids, shapes, finite values).
    """

    def __init__(self, folder: str | Path, target, examples: Sequence, layers: Sequence[int]):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.is_file():
            raise HiddenCacheError(
                f"{self.folder} has no {MANIFEST}: write the cache with "
                "scripts/dump_hidden_states.py first"
            )
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise HiddenCacheError(f"{path} is damaged ({e}); write the cache again") from e
        check_fingerprint(
            manifest["target_fingerprint"],
            target.fingerprint,
            f"the hidden-state cache in {self.folder}",
            error=HiddenCacheError,
            fix=f"dump the cache with the target {target.name!r}",
        )
        missing = sorted(set(target.check_layer_ids(layers)) - set(manifest["layers"]))
        if missing:
            raise HiddenCacheError(
                f"the cache in {self.folder} stores layers {manifest['layers']}, not {missing} "
                "that this head needs; dump it again with the head's config"
            )
        hashes = [ids_hash(e.input_ids) for e in examples]
        if hashes != manifest["examples"]:
            raise HiddenCacheError(
                f"the cache in {self.folder} holds {len(manifest['examples'])} examples that are "
                f"not the {len(hashes)} examples of this run's data config; dump it with the same "
                "data section (path, max_length, max_samples, eval_fraction, seed)"
            )
        covered = sum(s["count"] for s in manifest["shards"])
        if covered < len(hashes):
            raise HiddenCacheError(
                f"the cache in {self.folder} is incomplete ({covered} of {len(hashes)} examples); "
                "rerun scripts/dump_hidden_states.py with the same arguments to finish it"
            )
        self.manifest = manifest
        self.target = target
        self.layers = list(manifest["layers"])
        self.index = {h: i for i, h in enumerate(hashes)}
        self._shard_of = {}
        for s in manifest["shards"]:
            for i in range(s["start"], s["start"] + s["count"]):
                self._shard_of[i] = s["file"]
        self._open: dict[str, tuple] = {}  # shard file -> (safe_open handle, its keys)

    def _shard(self, name: str):
        """An open shard (safetensors reads each tensor on demand, so a training batch of
        examples from many shards costs what those examples weigh, not whole shards)."""
        handle = self._open.get(name)
        if handle is None:
            path = self.folder / name
            try:
                handle = safe_open(str(path), framework="pt")
                keys = set(handle.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise unreadable(path, e) from e
            if len(self._open) >= 32:  # bound the open files
                self._open.pop(next(iter(self._open)))
            self._open[name] = handle = (handle, keys)
        return handle

    def example(self, ids: Sequence[int]) -> dict[int, torch.Tensor]:
        """The cached layer -> (seq, hidden) states of the example with token ids `ids`, checked:
        the stored ids match, the shapes agree and the values are finite."""
        i = self.index.get(ids_hash(ids))
        if i is None:
            raise HiddenCacheError(
                f"an example of {len(ids)} tokens is not in the cache {self.folder}: the data "
                "differs from what was dumped"
            )
        name = self._shard_of[i]
        path = self.folder / name
        handle, keys = self._shard(name)
        wanted = [f"{i}.input_ids"] + [f"{i}.layer{layer}" for layer in self.layers]
        if not all(k in keys for k in wanted):
            raise HiddenCacheError(
                f"{path} lacks example {i} (or some of its layers {self.layers}); delete the "
                "shard and rerun scripts/dump_hidden_states.py to rewrite it"
            )
        try:
            tensors = {k: handle.get_tensor(k) for k in wanted}
        except (SafetensorError, OSError, ValueError) as e:
            raise unreadable(path, e) from e
        if tensors[wanted[0]].tolist() != list(ids):
            raise HiddenCacheError(f"{path}: the token ids of example {i} do not match the data")
        out = {}
        for layer, key in zip(self.layers, wanted[1:], strict=True):
            h = tensors[key]
            if h.shape != (len(ids), self.manifest["hidden_size"]):
                raise HiddenCacheError(
                    f"{path}: example {i} layer {layer} has shape {tuple(h.shape)}, "
                    f"expected ({len(ids)}, {self.manifest['hidden_size']})"
                )
            if not torch.isfinite(h).all():
                raise HiddenCacheError(
                    f"{path}: example {i} layer {layer} has non-finite values; delete the shard "
                    "and dump it again (fp16 overflows on some targets: use bf16 or fp32)"
                )
            out[layer] = h
        return out


def unreadable(shard: Path, err: Exception) -> HiddenCacheError:
    return HiddenCacheError(
        f"{shard} cannot be read ({err}): the shard is truncated or corrupt. Delete it and rerun "
        "scripts/dump_hidden_states.py with the same arguments to rewrite it"
    )


class CachedTarget:
    """Stands in for the target in the trainer: `forward` returns the cached hidden states and
    computes logits from the cached final state with the target's LM head (no target forward)."""

    def __init__(self, target, cache: HiddenStateCache):
        if target.num_layers not in cache.layers:
            raise HiddenCacheError(
                f"the cache in {cache.folder} lacks the final state (layer {target.num_layers}) "
                "that the target's distribution is computed from; dump it again"
            )
        self.target, self.cache = target, cache
        self.model, self.fingerprint, self.name = target.model, target.fingerprint, target.name
        self.num_layers, self.vocab_size = target.num_layers, target.vocab_size

    def to(self, device: torch.device | str) -> CachedTarget:
        """Move only what training from the cache uses, the input embedding and the LM head, to
        `device`: the decoder layers stay where they are (an 8B target's ~16 GB off each GPU).
        The full target is moved when it decodes (`report_after_training`)."""
        self.model.get_input_embeddings().to(device)
        self.model.get_output_embeddings().to(device)
        return self

    def __getattr__(self, name):  # embed, lm_head, tokenizer, ... come from the real target
        return getattr(self.target, name)

    @torch.no_grad()
    def forward(
        self, input_ids, *, attention_mask=None, capture_layers=(), logits_to_keep=0, **_ignored
    ) -> TargetOutput:
        B, T = input_ids.shape
        lengths = attention_mask.sum(1).tolist() if attention_mask is not None else [T] * B
        dtype, device = self.target.dtype, input_ids.device
        states = {
            layer: torch.zeros(B, T, self.target.hidden_size, dtype=dtype, device=device)
            for layer in {*capture_layers, self.num_layers}
        }
        for b in range(B):
            n = int(lengths[b])
            cached = self.cache.example(input_ids[b, :n].tolist())
            for layer, h in states.items():
                h[b, :n] = cached[layer].to(device=device, dtype=dtype)
        # (B, T, vocab), or only the last logits_to_keep positions', as a model's forward
        logits = self.target.lm_head(states[self.num_layers][:, -logits_to_keep:])
        return TargetOutput(logits=logits, hidden_states={i: states[i] for i in capture_layers})

    __call__ = forward
