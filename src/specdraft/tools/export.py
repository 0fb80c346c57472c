"""Write a trained drafter in a layout a serving engine reads.

    python scripts/export.py --format medusa runs/medusa-demo/final exports/medusa-demo
    python scripts/export.py --format vllm runs/medusa-demo/final exports/medusa-demo-vllm \\
        --base-model meta-llama/Llama-3.1-8B-Instruct
    python scripts/export.py --format speculators runs/eagle-demo/final exports/eagle-demo-vllm
    python scripts/export.py --format sglang runs/eagle-demo/final exports/eagle-demo-sglang
    python scripts/export.py --format eagle runs/eagle1-demo/final exports/eagle1-demo
    python scripts/export.py --format gguf runs/eagle-demo/final exports/eagle-demo-gguf

The drafter is loaded with the target it was trained for (its train_config.yaml's `target`, or
--target), which it must fit as load_drafter demands. --base-model (default: where the target
was loaded from) is recorded for engines that load the target themselves. OUT is written
atomically; an existing OUT is replaced only if it is empty or a previous export, or with
--force. Every folder is checked against the rules of the engine's own loader before it is
renamed into place. --format gguf writes llama.cpp's files with llama.cpp's own converter
(built once per machine: specdraft/llamacpp_build.py; formats/gguf_export.py says what it holds):
draft.gguf, the target's target.gguf and specdraft_gguf.json, for two-model drafts and EAGLE-3
heads. Formats (specdraft.formats.export_registry.FORMATS and kinds/eagle/eagle_export.py say what each
writes and what is exact):
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from specdraft.formats.checkpoint import CheckpointError, read_metadata
from specdraft.formats.export_registry import (
    FORMATS,
    ExportError,
    check_destination,
    export_drafter,
)
from specdraft.formats.gguf_export import GGUF_TYPES, NOT_SERVED, export_gguf
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.llamacpp_build import LlamaCppError, ensure_llamacpp
from specdraft.targets.target import TargetError, load_target
from specdraft.tools.arguments import new_parser

PROG = "scripts/export.py"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = export(args)
    except (CheckpointError, ExportError, TargetError, LlamaCppError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"[export] {args.format}: {', '.join(sorted(p.name for p in out.iterdir()))} in {out}")
    return 0


def export(args: argparse.Namespace) -> Path:
    folder, out = Path(args.folder).expanduser(), Path(args.out).expanduser()
    if out.resolve() == folder.resolve() or out.resolve() in folder.resolve().parents:
        raise ExportError(f"OUT {out} would replace the drafter folder {folder}; pick another")
    check_destination(out, args.force)  # before the minutes a large target takes to load
    engine = None
    if args.format == "gguf":
        kind = (read_metadata(folder)[0] or {}).get("kind", "distill")
        if kind in NOT_SERVED:  # before the engine is built or the target loaded
            raise ExportError(f"a {kind} drafter cannot be exported to GGUF: {NOT_SERVED[kind]}")
        engine = ensure_llamacpp()
    target = load_target(args.target or target_of(folder), dtype=args.dtype)
    drafter = load_drafter(folder, target)
    base_model = args.base_model or target.model.config._name_or_path
    decode = load_decoding(folder)  # the settings it was tuned to, where the format records them
    if engine is not None:
        return export_gguf(
            engine, drafter, target, out, decode, gguf_type=args.gguf_type,
            target_gguf=args.gguf_target,
        )  # fmt: skip
    return export_drafter(
        drafter, out, args.format, base_model_name_or_path=base_model, decode=decode,
        overwrite=args.force,
    )  # fmt: skip


def target_of(folder: Path) -> str:
    """The target the training config in `folder` names; an error saying to pass --target where
    there is none, or where the heads belong to a fine-tuned target (Medusa-2)."""
    meta, _ = read_metadata(folder)
    if ((meta or {}).get("config") or {}).get("lora", {}).get("rank", 0) > 0:
        raise ExportError(
            f"{folder} holds Medusa-2 heads, which decode with the fine-tuned target: pass "
            "--target OUTPUT_DIR/target (the run's merged target; or merge its adapter/)"
        )
    config = folder / "train_config.yaml"
    try:
        name = (yaml.safe_load(config.read_text()) or {}).get("target")
    except FileNotFoundError:
        name = None
    if not name:
        raise ExportError(f"{folder} names no target (no train_config.yaml): pass --target")
    return str(name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    formats = "\n".join(f"  {name:8} {f.help}" for name, f in FORMATS.items())
    formats += "\n  gguf     llama.cpp's draft.gguf + target.gguf (two-model drafts, EAGLE-3 heads)"
    parser = new_parser(__doc__ + formats, prog=PROG)
    parser.add_argument("folder", metavar="FOLDER", help="a trained drafter folder (final/, best/)")
    parser.add_argument("out", metavar="OUT", help="the folder to write")
    parser.add_argument("--format", required=True, choices=sorted([*FORMATS, "gguf"]))
    parser.add_argument("--base-model", default=None, help="recorded as base_model_name_or_path")
    parser.add_argument("--target", default=None, help="default: FOLDER/train_config.yaml's")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: as saved)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT whole")
    parser.add_argument(
        "--gguf-type", default="f16", choices=GGUF_TYPES, help="gguf: the drafter's matrices"
    )
    parser.add_argument(
        "--gguf-target",
        default="auto",
        metavar="auto|convert|none|FILE",
        help="gguf: the target beside it: a packaged target's own GGUF file, else its folder "
        "converted at --gguf-type (auto); converted (convert); none; or FILE copied",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
