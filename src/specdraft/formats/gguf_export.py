"""Drafters as GGUF files that llama.cpp serves (`scripts/export.py --format gguf`), written by
llama.cpp's own converter (convert_hf_to_gguf.py, from the engine specdraft/llamacpp_build.py builds;
never by hand), with the target beside them.

    kind      llama.cpp's --spec-type  what is converted
    distill   draft-simple             the student: a plain causal LM with the target's tokenizer
    eagle     draft-eagle3             an EAGLE-3 head, through speculators' Eagle3Speculator
                                       layout (kinds/eagle/eagle_export.py), with --target-model-dir
    dspark    draft-dspark             a DSpark drafter, through speculators' DSparkSpeculator
                                       layout (kinds/dspark/dspark_export.py), with
                                       --target-model-dir (its tokenizer, embedding and LM head)

An export folder holds:

    draft.gguf           the drafter, its matrices as --gguf-type (f16 default, f32, bf16, q8_0)
    target.gguf          the target: a packaged target's own GGUF file (SmolLM2-135M-Instruct's
                         original Q4_1), else the target's folder converted at --gguf-type;
                         absent with --gguf-target none
    specdraft_gguf.json  kind, --spec-type, the draft length it was tuned to (gamma), the target's
                         name and fingerprint, the converter's commit

and serves as `llama-server -m target.gguf -md draft.gguf --spec-type TYPE --spec-draft-n-max
GAMMA` (docs/serving.md). What llama.cpp does not serve is refused by name: Medusa heads,
LayerSkip's early exit, P-EAGLE's parallel drafting, EAGLE-1/2 heads, and DFlash drafters
(llama.cpp's converter reads DFlash in z-lab's layout only, not speculators' DFlashSpeculator;
its DSpark reader takes speculators' layout, so a DSpark drafter goes through).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from specdraft.core import DecodeConfig
from specdraft.drafters.base import Drafter
from specdraft.formats.checkpoint import clear_leftovers, replace_dir
from specdraft.formats.export_formats import ExportError
from specdraft.llamacpp_build import COMMIT, LlamaCpp
from specdraft.targets.target import Target, target_path

CONVERTER = Path(__file__).with_name("gguf_convert.py")
MANIFEST = "specdraft_gguf.json"
GGUF_TYPES = ("f16", "f32", "bf16", "q8_0")
SPEC_TYPES = {"distill": "draft-simple", "eagle": "draft-eagle3", "dspark": "draft-dspark"}
# the spec types whose drafter reads the target's layers' inputs (llama.cpp's target must hand
# them over)
READS_TARGET_LAYERS = ("draft-eagle3", "draft-dspark")
NOT_SERVED = {
    "medusa": "llama.cpp has no Medusa heads (its --spec-type offers draft models, EAGLE-3, "
    "DFlash, DSpark, MTP and n-gram lookups); serve Medusa with vLLM, TensorRT-LLM or TGI "
    "(--format medusa or vllm)",
    "layerskip": "llama.cpp has no early-exit self-speculation (LayerSkip drafts with the "
    "target's own first layers); serve it from our loop",
    "peagle": "llama.cpp has no P-EAGLE (parallel drafting) type; export with --format "
    "speculators for vLLM",
    "dflash": "llama.cpp's converter reads DFlash drafters in z-lab's layout "
    "(DFlashDraftModel), not speculators' DFlashSpeculator, which is what specdraft writes; "
    "export with --format speculators for vLLM, or train kind dspark, whose speculators layout "
    "llama.cpp reads (draft-dspark)",
}


def gguf_problem(drafter: Drafter) -> str | None:
    """Why llama.cpp cannot serve `drafter`, or None."""
    if drafter.kind in NOT_SERVED:
        return NOT_SERVED[drafter.kind]
    if drafter.kind == "eagle" and drafter.config.version != "eagle3":
        return (
            "llama.cpp serves EAGLE-3 heads (draft-eagle3), not EAGLE-1/2 ones; export this "
            "head with --format eagle for SGLang or vLLM"
        )
    if drafter.kind == "eagle" and drafter.config.norm_output:
        return (
            "llama.cpp's draft-eagle3 computes EAGLE-3.1's norm_before_fc but not its norm_output "
            "(it feeds each step the raw output back): export this head with --format "
            "speculators for vLLM"
        )
    if drafter.kind not in SPEC_TYPES:
        return f"llama.cpp serves no {drafter.kind} drafter"
    return None


def export_gguf(
    engine: LlamaCpp,
    drafter: Drafter,
    target: Target,
    out: Path,
    decode: DecodeConfig | None = None,
    gguf_type: str = "f16",
    target_gguf: str = "auto",
    log=print,
) -> Path:
    """`drafter` (and its target) as GGUF files in `out`, written atomically (a temporary folder
    beside it, renamed when complete). `target_gguf`: "auto" (the packaged target's own file, else
    converted), "convert", "none", or a GGUF file's path to copy."""
    problem = gguf_problem(drafter)
    if problem:
        raise ExportError(f"a {drafter.kind} drafter cannot be exported to GGUF: {problem}")
    if gguf_type not in GGUF_TYPES:
        raise ExportError(f"--gguf-type {gguf_type!r}: choose one of {', '.join(GGUF_TYPES)}")
    decode = decode or DecodeConfig()
    target_folder = Path(target_path(target.name))
    out.parent.mkdir(parents=True, exist_ok=True)
    clear_leftovers(out)  # an earlier export's, stopped before it cleaned up
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        with tempfile.TemporaryDirectory() as work:
            hf = Path(work) / "drafter"
            write_hf_folder(drafter, target, hf)
            convert(engine, hf, tmp / "draft.gguf", gguf_type, target_folder, log)
        target_file = place_target(engine, target, target_folder, tmp, target_gguf, gguf_type, log)
        if target_file:  # what llama.cpp would refuse or abort on, before the folder is in place
            problems = gguf_problems(
                tmp / target_file, tmp / "draft.gguf", SPEC_TYPES[drafter.kind],
                target.fingerprint, engine.source,
            )  # fmt: skip
            if problems:
                raise ExportError("; ".join(problems))
        (tmp / MANIFEST).write_text(
            json.dumps(
                {
                    "kind": drafter.kind,
                    "spec_type": SPEC_TYPES[drafter.kind],
                    "draft": "draft.gguf",
                    "draft_type": gguf_type,
                    "target": target_file,
                    "target_name": target.name,
                    "target_fingerprint": target.fingerprint,
                    "gamma": decode.gamma,
                    "llama_cpp": COMMIT,
                },
                indent=1,
            )
            + "\n"
        )
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_hf_folder(drafter: Drafter, target: Target, folder: Path) -> None:
    """The drafter as the Hugging Face folder llama.cpp's converter reads."""
    if drafter.kind == "distill":
        drafter.as_hf_model().save_pretrained(folder, safe_serialization=True)
        target.tokenizer.save_pretrained(folder)
        return
    from specdraft.formats.export_registry import export_drafter

    export_drafter(drafter, folder, "speculators", base_model_name_or_path=target.name)
    # without its copy of the target's embedding, llama.cpp's EAGLE-3 head reads the target's
    # own table: the same rows (the head was trained on them), V x H less to hold
    weights = folder / "model.safetensors"
    state = load_file(weights)
    state.pop("embed_tokens.weight", None)
    save_file(state, weights)


def convert(
    engine: LlamaCpp, folder: Path, out: Path, gguf_type: str, target_folder: Path | None, log
) -> None:
    """llama.cpp's converter on `folder`, writing `out`; its own error quoted where it fails."""
    command = [str(engine.python), str(CONVERTER), str(engine.source), str(folder)]
    command += ["--outfile", str(out), "--outtype", gguf_type]
    if target_folder is not None:
        command += ["--target-model-dir", str(target_folder)]
    env = {**os.environ, "NO_LOCAL_GGUF": "1"}  # the environment's gguf-py is the vendored one
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("[gguf]"):  # what gguf_convert.py added to the converter's work
            log(line)
    if done.returncode != 0 or not out.is_file():
        said = "\n".join(done.stderr.strip().splitlines()[-12:])
        raise ExportError(
            f"llama.cpp's converter could not convert {folder.name} (exit {done.returncode}); "
            f"it said:\n{said}"
        )
    log(f"[gguf] {out.name}: {out.stat().st_size / 2**20:.1f} MiB ({gguf_type})")


def place_target(
    engine: LlamaCpp,
    target: Target,
    folder: Path,
    out: Path,
    how: str,
    gguf_type: str,
    log,
) -> str | None:
    """The target's GGUF in `out` (see export_gguf's `target_gguf`); its file name, or None."""
    if how == "none":
        return None
    dest = out / "target.gguf"
    source = target_original(folder) if how == "auto" else None
    if how not in ("auto", "convert"):
        source = Path(how).expanduser()
        if not source.is_file():
            raise ExportError(f"--gguf-target {how}: no such file")
    if source is not None:
        try:
            os.link(source, dest)  # the same bytes; no second copy where one filesystem
        except OSError:
            shutil.copyfile(source, dest)
        log(f"[gguf] target.gguf: {source.name}, the target's own file")
    else:
        convert(engine, folder, dest, gguf_type, None, log)
    return dest.name


def target_original(folder: Path) -> Path | None:
    """The GGUF a packaged target was dequantized from (targets/packaged.py keeps it in
    original/), or None."""
    files = sorted((folder / "original").glob("*.gguf")) if (folder / "original").is_dir() else []
    return files[0] if len(files) == 1 else None


def gguf_fields(path: Path) -> dict:
    """The metadata of a GGUF file (no tensor is read)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises several types for a file that is not GGUF
        raise ExportError(f"{path} is not a GGUF file llama.cpp can read ({e})") from e
    fields = {}
    for name, field_ in reader.fields.items():
        if name == "tokenizer.ggml.tokens":
            fields[name] = field_.contents()
        elif not name.startswith("tokenizer.ggml.") or name.endswith(
            ("_id", "model", "pre", "_token")
        ):
            try:
                fields[name] = field_.contents()
            except (ValueError, IndexError):
                continue
    return fields


def gguf_problems(
    target: Path,
    draft: Path,
    spec_type: str,
    fingerprint: dict | None = None,
    source: Path | None = None,
) -> list[str]:
    """What llama.cpp would refuse, or serve wrongly, in serving `draft` for `target`, each a
    sentence: the vocabulary rules of its draft-model check (same tokenizer type, BOS and EOS,
    sizes within 128, the same token text), for an EAGLE-3 head the target's width and layers it
    reads, and the shape of the target the drafter was trained for (`fingerprint`, as its export
    recorded it: layers, width, vocabulary) against the target file's. With llama.cpp's
    `source`, an EAGLE-3 head for a target whose llama.cpp model does not hand its layers'
    inputs to a drafter (its src/models/ARCH.cpp never sets them) is refused: llama.cpp would
    abort on the first request. That last check is best-effort: an architecture whose file is
    named otherwise (gpt-oss is openai-moe.cpp) is not checked."""
    t, d = gguf_fields(target), gguf_fields(draft)
    tv, dv = t.get("tokenizer.ggml.tokens") or [], d.get("tokenizer.ggml.tokens") or []
    arch = t.get("general.architecture")
    width, layers = t.get(f"{arch}.embedding_length"), t.get(f"{arch}.block_count")
    problems = []
    if spec_type == "draft-eagle3":  # it drafts target ids (d2t): only the sizes must agree
        if len(tv) != len(dv):
            problems.append(f"vocabulary sizes {len(tv)} (target) and {len(dv)} (drafter)")
    else:  # a draft model: llama.cpp's own check (common/speculative.cpp)
        keys = ["tokenizer.ggml.model"]
        for w in ("bos", "eos"):  # where both files say whether it is added, they must agree
            flag = f"tokenizer.ggml.add_{w}_token"
            if flag in t and flag in d:
                keys.append(flag)
            if t.get(flag) or d.get(flag):
                keys.append(f"tokenizer.ggml.{w}_token_id")
        for key in keys:
            if t.get(key) != d.get(key):
                problems.append(
                    f"{key.split('.')[-1]}: the target's is {t.get(key)!r}, the drafter's "
                    f"{d.get(key)!r}"
                )
        if abs(len(tv) - len(dv)) > 128:
            problems.append(f"vocabulary sizes {len(tv)} (target) and {len(dv)} (drafter)")
        differ = [i for i in range(5, min(len(tv), len(dv))) if tv[i] != dv[i]]
        if differ:
            i = differ[0]
            problems.append(
                f"{len(differ)} tokens differ in text, the first id {i}: {tv[i]!r} in the "
                f"target, {dv[i]!r} in the drafter"
            )
    if problems:
        problems = [
            f"{draft.name} was made with another tokenizer than {target.name}'s: "
            + "; ".join(problems)
            + ". Export the drafter with the target it was trained for (where the target's own "
            "GGUF writes the same tokenizer otherwise, --gguf-target convert writes both files "
            "from one folder)"
        ]
    if spec_type == "draft-eagle3":
        wants = d.get("eagle3.target_hidden_size")
        if wants != width:
            problems.append(
                f"the EAGLE-3 head reads a target of width {wants}; {target.name} has {width}: "
                "it was exported for another target"
            )
        reads = list(d.get("eagle3.target_layers") or [])
        if layers is not None and any(i > layers for i in reads):
            problems.append(
                f"the EAGLE-3 head reads target layers {reads}; {target.name} has {layers}"
            )
    model = source / "src" / "models" / f"{arch}.cpp" if source else None
    if (
        spec_type in READS_TARGET_LAYERS
        and model is not None
        and model.is_file()
        and "t_layer_inp" not in model.read_text()
    ):
        problems.append(
            f"llama.cpp {COMMIT} cannot serve a {spec_type} drafter for a {arch} target: its "
            f"{arch} model does not hand its layers' inputs to a drafter (it aborts on the "
            "first request); serve this drafter with vLLM (--format speculators)"
        )
    found = {"num_layers": layers, "hidden_size": width, "vocab_size": len(tv) or None}
    differ = [
        f"{key} {fingerprint[key]} (trained for) against {value} ({target.name})"
        for key, value in found.items()
        if fingerprint and key in fingerprint and value is not None and value != fingerprint[key]
    ]
    if differ:
        problems.append(
            "the drafter was trained for another target: " + ", ".join(differ) + "; pass the "
            "target it was exported with (--target-gguf)"
        )
    return problems
