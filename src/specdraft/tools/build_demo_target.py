"""Build the demo target: a small Llama trained on the standard library's Python source.

    python scripts/build_demo_target.py                 # the default demo target (~32 min, 2 cores)
    python scripts/build_demo_target.py --variant tiny  # the seconds-long variant tests use
    python scripts/build_demo_target.py --budget long   # 3x the training tokens, better text
    python scripts/build_demo_target.py --report        # also measure decoding speed and loops

The result is a standard HF model folder (AutoModelForCausalLM / AutoTokenizer load it offline)
cached under $SPECDRAFT_HOME/demo-target/ (default ~/.cache/specdraft); the building code is
specdraft.targets.demo_target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from specdraft.targets.demo_target import (
    BUDGETS,
    COMPLETE_MARKER,
    SPECS,
    ensure_demo_target,
    report,
    resolve_spec,
)
from specdraft.tools.arguments import new_parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        path = ensure_demo_target(args.variant, args.budget, args.seed, args.force, args.overrides)
    except ValueError as err:
        print(f"build_demo_target.py: error: {err}", file=sys.stderr)
        return 2
    info = json.loads((path / COMPLETE_MARKER).read_text())
    info["path"] = str(path)
    if args.report:
        with contextlib.redirect_stdout(sys.stderr):
            info["report"] = report(path, num_prompts=args.num_prompts)
    print(json.dumps(info, indent=2))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options; args.overrides holds --set's items, checked against the build settings."""
    parser = new_parser(__doc__)
    parser.add_argument("--variant", default="default", choices=sorted(SPECS))
    parser.add_argument("--budget", default="default", choices=sorted(BUDGETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--report", action="store_true", help="measure decoding speed and loops")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override build settings, e.g. --set hidden_size=384 num_layers=6 lr=2e-3 "
        "precision=fp32",
    )
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set takes KEY=VALUE items, got {item!r}")
        overrides[key] = _number_or_text(value)
    try:  # an unknown --set key fails here, before anything is built
        resolve_spec(args.variant, args.budget, args.seed, overrides)
    except ValueError as err:
        parser.error(str(err))
    args.overrides = overrides
    return args


def _number_or_text(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


if __name__ == "__main__":
    sys.exit(main())
