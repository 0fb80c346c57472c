"""Folders specdraft builds once and keeps under SPECDRAFT_HOME (default ~/.cache/specdraft): the
demo target (targets/demo_target.py), the dequantized real targets (targets/packaged.py), the
benchmark prompt sets (data/benchmarks.py).

`build_once` makes such a folder safely from several processes at once (one builds under a file
lock while the others wait and reuse it) and atomically (it is assembled under a temporary name
beside it and renamed when complete), so a killed build or a full disk leaves nothing
half-written in the cache.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


class CacheError(ValueError):
    """A cached folder that could not be built (a full disk, a build that wrote no marker)."""


def specdraft_home() -> Path:
    return Path(os.environ.get("SPECDRAFT_HOME", "~/.cache/specdraft")).expanduser()


def build_once(
    out: Path, build: Callable[[Path], object], what: str, marker: str, *, force: bool = False
) -> Path:
    """`out`, made by `build(tmp)` into a temporary folder beside it and renamed when complete
    (holding the file `marker`), unless it is there already (or `force`)."""
    if (out / marker).exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / marker).exists() and not force:
            return out
        for stale in out.parent.glob(
            f".{glob.escape(out.name)}-*"
        ):  # holding the lock: a killed build's
            shutil.rmtree(stale, ignore_errors=True)
        print(f"[specdraft] building {what} in {out}", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            build(tmp)
            if not (tmp / marker).exists():
                raise CacheError(f"building {what} wrote no {marker}")
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)  # atomic: a folder with its marker is always complete
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CacheError(
                    f"the disk is full while building {what} under {out.parent} ({err}); "
                    "nothing was left in the cache: free space there or point SPECDRAFT_HOME "
                    "at a larger disk, and retry"
                ) from err
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
