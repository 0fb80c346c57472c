"""llama.cpp, the CPU user's serving engine, built once per machine from the source the package
registry ships (docs/serving.md, "Serve on a CPU with llama.cpp").

The `llama-cpp-python==0.3.36` source distribution vendors llama.cpp at commit 0c1e570
(2026-10-01): its server (`llama-server`, with `--spec-type draft-simple|draft-eagle3|...` and the
n-gram drafters), its converter (`convert_hf_to_gguf.py`) and the `gguf` package that converter
needs. `ensure_llamacpp()` fetches it with the ordinary pip client, checks its sha256, builds the
server with CMake (CPU, the machine's native instructions, static, no curl or OpenSSL, no web UI)
and makes the converter's own virtual environment (torch and transformers pinned to ours, the
vendored gguf-py, sentencepiece), all under SPECDRAFT_ENGINES (default
SPECDRAFT_HOME/engines, ~/.cache/specdraft/engines). The folder is assembled beside its final
name and renamed when complete (specdraft/cache.py's build_once), so a build that is interrupted
leaves nothing that is used: the next call builds it again. Its marker records how long the build
took and on which CPU.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specdraft.cache import CacheError, build_once, specdraft_home
from specdraft.registry import check_sha256, pip_download

REQUIREMENT = "llama-cpp-python==0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
COMMIT = "0c1e570"  # vendor/llama.cpp in that source distribution
NAME = f"llama.cpp-{COMMIT}"
MARKER = ".specdraft-ready"
BINARIES = ("llama-server",)
# The converter's Python dependencies beside torch and transformers (pinned to ours, so a folder
# our transformers saved is read as it was written): llama.cpp's
# requirements/requirements-convert_hf_to_gguf.txt, whose transformers pin predates the
# tokenizer files transformers 5 writes.
CONVERTER_REQUIREMENTS = ("numpy", "sentencepiece>=0.1.98,<0.3.0", "safetensors", "protobuf")
BUILD_TIMEOUT_S = 3600


class LlamaCppError(CacheError):
    """llama.cpp that cannot be built here, or that refused or failed what it was given."""


def engines_dir() -> Path:
    """Where the engines' environments live: SPECDRAFT_ENGINES, else SPECDRAFT_HOME/engines
    (default ~/.cache/specdraft/engines)."""
    if os.environ.get("SPECDRAFT_ENGINES"):
        return Path(os.environ["SPECDRAFT_ENGINES"]).expanduser()
    return specdraft_home() / "engines"


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its folder, its source (the converter's too), the server, and the
    interpreter that runs the converter."""

    root: Path

    @property
    def source(self) -> Path:
        return self.root / "src"

    @property
    def server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def build_info(self) -> dict:
        return json.loads((self.root / MARKER).read_text())


def built_llamacpp() -> LlamaCpp | None:
    """The machine's llama.cpp if it has been built (nothing is fetched or built here)."""
    root = engines_dir() / NAME
    return LlamaCpp(root) if (root / MARKER).is_file() else None


def ensure_llamacpp(log=print) -> LlamaCpp:
    """The machine's llama.cpp, built on first use (about 8 minutes on 2 cores) and reused.
    Safe from several processes at once: one builds under a file lock, the others wait."""
    found = built_llamacpp()
    if found is not None:
        return found
    missing_tools()  # before the download
    root = engines_dir() / NAME
    log(f"[llama.cpp] building {NAME} from {REQUIREMENT}'s source in {root}, once per machine")
    build_once(root, _build, f"llama.cpp {COMMIT}", MARKER)
    return LlamaCpp(root)


def missing_tools() -> None:
    """LlamaCppError naming each build tool this machine lacks, and how to get it."""
    needed = {"cmake": "cmake", "a C++ compiler (c++)": "c++", "a C compiler (cc)": "cc"}
    missing = [what for what, exe in needed.items() if shutil.which(exe) is None]
    if missing:
        raise LlamaCppError(
            f"building llama.cpp needs {', '.join(missing)}, which this machine lacks (PATH: "
            f"{os.environ.get('PATH', '')}): install them (Debian/Ubuntu: apt install cmake "
            "g++; macOS: xcode-select --install and brew install cmake) and retry"
        )


def _build(out: Path) -> None:
    """Fetch, check, unpack, compile and make the converter's environment in `out`."""
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        sdist = pip_download(
            REQUIREMENT, Path(tmp), instead="build llama.cpp yourself", source=True
        )
        check_sha256(sdist, SDIST_SHA256, f"{REQUIREMENT}'s source distribution")
        with tarfile.open(sdist) as archive:
            prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            for m in members:
                m.name = m.name[len(prefix) :]
            archive.extractall(out / "src", members=members, filter="data")
    fetched = time.time()
    build = out / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(
        [
            "cmake", "-S", str(out / "src"), "-B", str(build), *generator,
            "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF",
        ],
        "configuring llama.cpp with cmake",
    )  # fmt: skip
    jobs = str(os.cpu_count() or 2)
    _run(
        ["cmake", "--build", str(build), "-j", jobs, "--target", *BINARIES],
        "compiling llama.cpp",
    )
    (out / "bin").mkdir()
    for name in BINARIES:
        shutil.copy2(build / "bin" / name, out / "bin" / name)
    shutil.rmtree(build)  # objects: hundreds of MB no one reads again
    compiled = time.time()
    _make_converter_venv(out)
    (out / MARKER).write_text(
        json.dumps(
            {
                "source": REQUIREMENT,
                "commit": COMMIT,
                "built": time.strftime("%Y-%m-%d %H:%M:%S"),
                "cpu": cpu_name(),
                "cores": os.cpu_count(),
                "seconds": {
                    "fetch": round(fetched - start),
                    "compile": round(compiled - fetched),
                    "converter": round(time.time() - compiled),
                },
            },
            indent=1,
        )
        + "\n"
    )


def _make_converter_venv(out: Path) -> None:
    import torch
    import transformers

    venv = out / "venv"
    python = venv / "bin" / "python"
    pins = [
        f"torch=={torch.__version__.split('+')[0]}",
        f"transformers=={transformers.__version__}",
    ]
    _run([sys.executable, "-m", "venv", str(venv)], "making the converter's environment")
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, *pins, *CONVERTER_REQUIREMENTS], "installing the converter's requirements")
    _run([*pip, str(out / "src" / "gguf-py")], "installing llama.cpp's gguf-py")


def _run(command: list[str], what: str) -> None:
    try:
        done = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=BUILD_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise LlamaCppError(f"{what} took over {BUILD_TIMEOUT_S} s; nothing was kept") from e
    if done.returncode != 0:
        lines = done.stdout.strip().splitlines()  # Ninja writes the compiler's errors there
        errors = [line for line in lines if "error" in line.lower()]
        said = "\n".join(([*errors[:10], "..."] if errors else []) + lines[-8:])
        raise LlamaCppError(
            f"{what} failed (exit {done.returncode}); nothing was kept, the next call builds "
            f"again. Its last lines:\n{said}"
        )


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
