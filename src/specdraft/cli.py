"""The `specdraft` command: one entry point for training every kind and for every tool.

    specdraft train KIND [--config PATH|NAME] [key=value ...]    (specdraft train --help: kinds)
    specdraft evaluate | compare | tune | export | verify-export | ... [ARGS]
    specdraft configs                     where the shipped configs are, each kind's recipes

`specdraft train eagle` is `python train/eagle.py` in a checkout; for several processes,
`accelerate launch -m specdraft train eagle` (or `accelerate launch train/eagle.py`). Each tool is
the module of the same name in specdraft/tools (`verify-export`: tools/verify_export.py), which
`python scripts/TOOL.py` runs from a checkout.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from specdraft.config import SHIPPED_CONFIGS

# The command of each tool and what it does, in the order `specdraft --help` lists them
TOOLS = {
    "evaluate": "decode prompts with drafters beside plain decoding: tau, speedups, outputs",
    "compare": "train every kind on one target at equal tokens and measure them side by side",
    "tune": "choose a drafter's decoding settings by measured tokens/s on this machine",
    "export": "write a drafter in an engine's layout (speculators, EAGLE, Medusa, GGUF)",
    "verify-export": "load an export in its engine and check its outputs against ours",
    "regenerate": "rewrite training data as the target's own answers",
    "dump-hidden-states": "cache the target's hidden states for offline training",
    "parity": "check the loop's outputs against transformers' generate",
    "profile-drafting": "where a drafter's step spends its time",
    "memory-plan": "the memory a training run will need, before it runs",
    "build-demo-target": "build and train the 7.4M-parameter demo target",
}


def _usage() -> str:
    width = max(map(len, TOOLS))
    lines = [
        "usage: specdraft COMMAND [ARGS]  (specdraft COMMAND --help: its arguments)",
        "",
        f"  {'train':<{width}}  train a drafter: specdraft train KIND [--config PATH] [key=value ...]",
        *(f"  {name:<{width}}  {what}" for name, what in TOOLS.items()),
        f"  {'configs':<{width}}  where the shipped configs are, and each kind's recipes",
    ]
    return "\n".join(lines)


def _train(argv: list[str], prog: str | None = None) -> int:
    from specdraft.train.entry import main, trained_kinds

    kinds = trained_kinds()
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: specdraft train KIND [--config PATH|NAME] [key=value ...]\n\n"
            f"KIND: {', '.join(kinds)} (specdraft train KIND --help lists every key)"
        )
        return 0 if argv else 2
    if argv[0] not in kinds:
        print(
            f"specdraft train: error: no kind {argv[0]!r}: choose one of {', '.join(kinds)}",
            file=sys.stderr,
        )
        return 2
    return main(argv[0], argv[1:], prog=prog or f"specdraft train {argv[0]}")


def _configs() -> int:
    print(f"shipped configs: {SHIPPED_CONFIGS}")
    for folder in sorted(p for p in SHIPPED_CONFIGS.iterdir() if p.is_dir()):
        names = sorted(p.name for p in folder.iterdir())
        print(f"  {folder.name}/: {', '.join(names)}")
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run `specdraft COMMAND ...`: its exit status (2 for an unknown command). `prog` names
    the command in a tool's usage and errors (default: `specdraft COMMAND`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return _train(rest)
    if command == "configs":
        return _configs()
    if command not in TOOLS:
        print(f"specdraft: error: no command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"specdraft.tools.{command.replace('-', '_')}")
    sys.argv[0] = prog or f"specdraft {command}"  # what argparse names in the tool's usage
    return module.main(rest)


def launch(path: str) -> None:
    """Run the checkout launcher at `path` (scripts/TOOL.py, train/KIND.py) as the command it
    stands for, and exit with its status."""
    file = Path(path)
    if file.parent.name == "train":
        sys.exit(_train([file.stem, *sys.argv[1:]], prog=f"train/{file.name}"))
    sys.exit(main([file.stem.replace("_", "-"), *sys.argv[1:]], prog=f"scripts/{file.name}"))
