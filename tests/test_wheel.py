"""The installable product: a wheel built from this checkout, installed into a fresh virtual
environment outside it, runs `specdraft` with the configs it ships (docs/architecture.md,
"Layout").

The fresh environment gets its dependencies from this one's site-packages (a .pth line, so the
test installs nothing from the registry) but not this one's editable specdraft: a folder named
by a .pth line is not a site directory, so its own .pth files (the editable install's hook) are
not read. The specdraft it imports is the wheel's, which the test checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(args: list, cwd: Path, env: dict) -> str:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the fresh environment's bin folder, a working folder outside the checkout, its env)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # build from a copy, so that setuptools' build/ and egg-info stay out of the checkout
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    dist = tmp / "dist"
    # no build isolation: the setuptools of this environment (the dev extra's), nothing fetched
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", dist, source], tmp, {**os.environ, "PIP_NO_INPUT": "1"})  # fmt: skip
    (wheel,) = dist.glob("specdraft-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("specdraft/configs/eagle/demo.yaml", "specdraft/configs/accelerate/cpu_2proc.yaml",
                    "specdraft/configs/deepspeed/zero2.json", "specdraft/cli.py",
                    "specdraft/tools/verify_export_engine.py"):  # fmt: skip
        assert shipped in names, f"the wheel lacks {shipped}"
    assert any(n.startswith("specdraft/data/answers/") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, dict(os.environ))
    bin_dir = venv / "bin"
    here = sysconfig.get_paths()["purelib"]
    site = Path(
        _run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
             tmp, dict(os.environ)).strip()
    )  # fmt: skip
    (site / "dependencies.pth").write_text(here + "\n")
    _run([sys.executable, "-m", "pip", "--python", bin_dir / "python", "install", "--no-deps",
          "-q", wheel], tmp, dict(os.environ))  # fmt: skip
    work = tmp / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("SPECDRAFT_CONFIGS", "PYTHONPATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return bin_dir, work, env


def test_the_installed_specdraft_is_the_wheels(installed):
    bin_dir, work, env = installed
    out = _run([bin_dir / "python", "-c", "import specdraft; print(specdraft.__file__)"], work, env)
    assert Path(out.strip()).is_relative_to(bin_dir.parent), out
    configs = _run([bin_dir / "specdraft", "configs"], work, env)
    assert str(bin_dir.parent) in configs.splitlines()[0] and "eagle/: demo.yaml" in configs


def test_train_eagle_help_reads_the_shipped_demo_config(installed):
    bin_dir, work, env = installed
    out = _run([bin_dir / "specdraft", "train", "eagle", "--help"], work, env)
    assert "usage: specdraft train eagle" in out
    # the default config is the shipped one, inside the fresh environment
    assert str(bin_dir.parent) in out and "eagle/demo.yaml" in out
    # a recipe by name, as a wheel user has no checkout path to give
    out = _run([bin_dir / "specdraft", "train", "eagle", "--config", "llama3.1-8b-eagle3.yaml",
                "--help"], work, env)  # fmt: skip
    assert "llama3.1-8b-eagle3.yaml" in out


def test_a_tiny_run_trains_from_the_wheel(installed, tiny_target_path):
    bin_dir, work, env = installed
    out = work / "run"
    _run([bin_dir / "specdraft", "train", "eagle",
          "--config", ROOT / "tests" / "configs" / "eagle" / "demo.yaml",
          f"target={tiny_target_path}", "max_steps=2", "micro_batch_size=2", "eval_every=0",
          "save_every=0", "eval_loop.enabled=false", "drafter.draft_vocab_size=256",
          f"output_dir={out}"],
         work, {**env, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert (out / "final" / "model.safetensors").is_file()
    assert (out / "final" / "config.json").is_file()
