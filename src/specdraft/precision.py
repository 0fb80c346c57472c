"""Which floating-point precision a machine runs fast, and the one place that decides it.

bf16 is a different machine on CPUs with native bf16 (AVX-512 BF16, AMX): a bf16 matmul runs
2-10x faster than fp32 there (git history of BENCHMARKS.md, "Precision"), so the demo target's
build and the trainer's autocast use it where it exists. Elsewhere bf16 is emulated and slower
than fp32, so "auto" falls back to fp32 and says so once. GPUs: bf16 where torch says the device
supports it.

`SPECDRAFT_NO_BF16=1` makes every CPU look like one without native bf16: the fallback, testable
on any machine.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from pathlib import Path

import torch

# CPU flags (Linux /proc/cpuinfo) that mean bf16 arithmetic runs in hardware.
BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86: AVX-512 BF16, AMX; arm64: FEAT_BF16
FORCE_FALLBACK_ENV = "SPECDRAFT_NO_BF16"

_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "no": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The first CPU's feature flags, lower case; empty where the file does not exist."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.lower().split())
    return set()


@functools.cache
def _native_cpu_bf16() -> bool:
    return bool(cpu_flags() & BF16_CPU_FLAGS) and platform.machine().lower() in (
        "x86_64", "amd64", "aarch64", "arm64",
    )  # fmt: skip


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether `device` runs bf16 arithmetic in hardware (not forced off by SPECDRAFT_NO_BF16)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if os.environ.get(FORCE_FALLBACK_ENV, "") not in ("", "0"):
        return False
    return device.type == "cpu" and _native_cpu_bf16()


_said: set[str] = set()


def say_once(message: str) -> None:
    """Print a one-line [specdraft] notice to stderr, once per process."""
    if message not in _said:
        _said.add(message)
        print(f"[specdraft] {message}", file=sys.stderr)


def resolve_precision(precision: str, device: str | torch.device = "cpu", what: str = "") -> str:
    """ "auto" -> "bf16" where the device has native bf16, else "fp32" with one line saying so.
    An explicit "bf16", "fp32" or "fp16" is kept (bf16 without hardware support runs, emulated
    and slow, with one line saying that)."""
    if precision not in ("auto", "bf16", "fp32", "fp16"):
        raise ValueError(f"unknown precision {precision!r}; choose auto, bf16, fp32 or fp16")
    if precision not in ("auto", "bf16") or native_bf16(device):
        return "bf16" if precision == "auto" else precision
    kind = torch.device(device).type
    where = f" for {what}" if what else ""
    if precision == "auto":
        say_once(f"{kind} has no native bf16 ({_why_not(device)}): using fp32{where}")
        return "fp32"
    say_once(
        f"bf16 asked{where}, but {kind} has no native bf16 ({_why_not(device)}): emulated, "
        "slower than fp32"
    )
    return "bf16"


def _why_not(device: str | torch.device) -> str:
    if torch.device(device).type == "cpu" and os.environ.get(FORCE_FALLBACK_ENV, "") not in (
        "",
        "0",
    ):
        return f"{FORCE_FALLBACK_ENV} is set"
    return (
        "no avx512_bf16 / amx_bf16 / bf16 CPU flag"
        if torch.device(device).type == "cpu"
        else ("torch.cuda.is_bf16_supported() is False")
    )


def dtype_name(dtype: torch.dtype) -> str:
    """float32, bfloat16, ...: a dtype as configs and reports spell it (to_dtype reads it)."""
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype from its name (float32/fp32/no, bfloat16/bf16, float16/fp16) or itself."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]
