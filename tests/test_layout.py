"""The library is src/specdraft, each folder its import path (docs/architecture.md, "Layout")."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "src" / "specdraft"


@pytest.mark.parametrize(
    "package",
    [
        "data",
        "targets",
        "drafters",
        "formats",
        "inference",
        "simulation",
        "measuring",
        "train",
        "tools",
    ],
)
def test_subpackages_resolve_to_this_repository(package):
    module = importlib.import_module(f"specdraft.{package}")
    assert Path(module.__file__).resolve() == LIBRARY / package / "__init__.py"


def test_imports_work_from_any_directory(tmp_path):
    code = "import specdraft.data, specdraft.targets.target; print(specdraft.data.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert Path(out.stdout.strip()).resolve() == LIBRARY / "data" / "__init__.py"


def test_every_library_file_name_is_one_module():
    """No two modules of the library share a file name (docs/architecture.md, "Layout")."""
    seen: dict[str, list[str]] = {}
    for path in LIBRARY.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(LIBRARY)))
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not repeated, repeated


def test_demo_prompts_is_exported():
    from specdraft.data import demo_prompts

    assert len(demo_prompts(3)) == 3


# The layering (docs/architecture.md, "Layers"): a package may import only from the packages
# below it.
# specdraft (core) <- data <- targets <- drafters <- formats <- inference (the loop) <- simulation
# <- measuring <- train <- tools <- cli
LAYERS = [
    "specdraft", "data", "targets", "drafters", "formats", "inference", "simulation", "measuring",
    "train", "tools", "cli",
]  # fmt: skip


def _imports(path: Path) -> set[str]:
    """Every specdraft module `path` imports, at any depth (lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("specdraft"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specdraft"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _package(module: str) -> str | None:
    """The layer of a dotted module name: specdraft.drafters.base -> drafters; a kind's module by
    what it is (specdraft.kinds.eagle.eagle_export -> formats)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS[1:]:
        return parts[1]
    if len(parts) > 3 and parts[1] == "kinds":
        return _kind_layer(parts[3])
    if parts[:2] == ["specdraft", "kinds"]:
        return "drafters"  # a kind's package itself
    if parts[:2] == ["specdraft", "__main__"]:
        return "cli"
    return "specdraft" if parts[0] == "specdraft" else None


def _kind_layer(name: str) -> str:
    """The layer of a module in a kind's folder: its trainer is in train, its export in formats,
    the rest (drafter, config, session, layers) in drafters."""
    if name.endswith("_trainer"):
        return "train"
    if name.endswith(("_export", "_formats")):
        return "formats"
    return "drafters"


def _library_files() -> list[tuple[str, Path]]:
    files = []
    for layer in LAYERS[1:-1]:
        files += [(layer, p) for p in sorted((LIBRARY / layer).glob("*.py"))]
    files += [(_kind_layer(p.stem), p) for p in sorted((LIBRARY / "kinds").glob("*/*.py"))]
    for path in sorted(LIBRARY.glob("*.py")):
        files.append(("cli" if path.stem in ("cli", "__main__") else "specdraft", path))
    return files


def test_imports_run_down_the_layers_only():
    """No package imports a package above it, so there is no cycle between packages and no
    library module imports a tool or the command line."""
    wrong = []
    for layer, path in _library_files():
        for module in _imports(path):
            other = _package(module)
            if other is not None and LAYERS.index(other) > LAYERS.index(layer):
                wrong.append(
                    f"{path.relative_to(ROOT)} imports {module} ({other} is above {layer})"
                )
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_sees_a_violation(tmp_path):
    """The check above is not vacuous: it parses imports the way the tree writes them."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from specdraft.tools.evaluate import main\n")
    assert "specdraft.tools.evaluate" in _imports(bad)
    assert _package("specdraft.tools.evaluate") == "tools"
    assert _package("specdraft.cli") == "cli"
    assert _package("specdraft.core") == "specdraft"
    assert _package("specdraft.kinds.eagle.eagle_trainer") == "train"
    assert _package("specdraft.kinds.eagle.eagle_session") == "drafters"
    assert len(_library_files()) > 30


def test_each_kind_is_one_folder():
    """Every built-in kind (but the loop's own prompt lookup) lives in specdraft/kinds/KIND, and
    no module of a kind sits outside its folder."""
    from specdraft.drafters.base import drafter_kinds

    # the built-in kinds: a test may register one of its own (tests/test_new_kind.py)
    kinds = {k for k, cls in drafter_kinds().items() if cls.__module__.startswith("specdraft.")}
    kinds -= {"prompt_lookup"}
    assert kinds == {p.name for p in (LIBRARY / "kinds").iterdir() if (p / "__init__.py").is_file()}
    strays = [
        str(p.relative_to(LIBRARY))
        for p in LIBRARY.rglob("*.py")
        if "kinds" not in p.parts and p.stem.split("_")[0] in kinds
    ]
    assert not strays, strays


# The code every kind shares knows kinds only through the Drafter hooks and the registry
# (docs/architecture.md, "Drafter").
SHARED = [
    "train/trainer.py", "train/train_config.py", "train/entry.py", "train/beside_target.py",
    "formats/checkpoint.py",
    "inference/generate.py", "measuring/tuning.py", "measuring/measure.py", "measuring/evaluation.py",
    "measuring/evaluation_report.py",
    "measuring/report_writer.py", "train/comparison.py", "tools/tune.py", "tools/evaluate.py",
    "tools/compare.py", "cli.py",
]  # fmt: skip


def test_shared_code_names_no_kind_and_probes_no_hook():
    """No string literal in the shared code is a registered kind's name, and no hasattr/getattr
    asks a drafter or a session whether it has a hook. Shown to fail: with the old
    `if drafter.kind == "layerskip":` in measuring/evaluation.py it names the line."""
    from specdraft.drafters.base import drafter_kinds

    # the built-in kinds: a test may register one of its own (tests/test_new_kind.py)
    kinds = {k for k, cls in drafter_kinds().items() if cls.__module__.startswith("specdraft.")}
    kinds -= {"prompt_lookup"}  # the loop's own drafter, not a kind
    wrong = []
    for name in SHARED:
        tree = ast.parse((LIBRARY / name).read_text(), filename=name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in kinds:
                wrong.append(f"{name}:{node.lineno} names the kind {node.value!r}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr")
                and node.args
                and ast.unparse(node.args[0]).split(".")[-1]
                in ("drafter", "session", "model", "unwrapped", "cls", "type(drafter)")
            ):
                wrong.append(f"{name}:{node.lineno} probes a hook: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


def test_every_library_module_imports_first():
    """Each module imports when it is the first of the library imported (a cycle inside one
    layer, which the layer check cannot see, fails here): in one fresh process, every module is
    imported with no specdraft module loaded before it."""
    modules = sorted(
        ".".join(p.relative_to(LIBRARY.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in LIBRARY.rglob("*.py")
        if p.name != "__main__.py" and p.stem != "verify_export_engine"
    )
    code = (
        "import importlib, sys\n"
        "failed = []\n"
        f"for name in {modules!r}:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] == 'specdraft']:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(failed))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert not out.stdout.strip(), out.stdout
