"""A DecodeConfig's batch_schedule, checked (docs/tuning.md, "By batch size"): entries by
increasing batch_size, each `off: true` or settings of the DecodeConfig's own class with their
values of the settings' types, written as a saved JSON's, a YAML file's text or Python values."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdraft.core import DecodeConfig


def checked_schedule(settings: DecodeConfig) -> list[dict[str, Any]]:
    """batch_schedule as written (a saved JSON's, a YAML file's text or Python values),
    checked: each entry a batch_size (increasing from entry to entry) with off: true or
    settings of its own class, their values of the settings' types and within their limits. A
    ValueError names the entry and what to change."""
    schedule = settings.batch_schedule
    if not isinstance(schedule, Sequence) or isinstance(schedule, (str, bytes)):
        raise ValueError(
            f"batch_schedule must be a list of entries, e.g. [{{batch_size: 1, gamma: 4}}, "
            f"{{batch_size: 16, off: true}}]; got {schedule!r}"
        )
    names = {f.name: f for f in dataclasses.fields(settings)}
    checked: list[dict[str, Any]] = []
    for i, entry in enumerate(schedule, 1):
        where = f"batch_schedule entry {i}"
        if not isinstance(entry, Mapping) or "batch_size" not in entry:
            raise ValueError(
                f"{where} is {entry!r}: write each entry as a mapping with its batch_size, "
                "e.g. {batch_size: 4, gamma: 3} or {batch_size: 16, off: true}"
            )
        values = dict(entry)
        size = _typed(int, values.pop("batch_size"))
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{where}: batch_size must be an integer >= 1; got {size!r}")
        if checked and size <= checked[-1]["batch_size"]:
            raise ValueError(
                f"{where}: batch_size {size} follows batch_size "
                f"{checked[-1]['batch_size']}; list the entries by increasing batch_size, "
                "each batch size once"
            )
        where = f"batch_schedule entry {i} (batch_size {size})"
        off = _typed(bool, values.pop("off", False))
        if not isinstance(off, bool):
            raise ValueError(f"{where}: off must be true or false; got {off!r}")
        if off and values:
            raise ValueError(
                f"{where}: off turns drafting off, so {', '.join(sorted(values))} would do "
                "nothing there; drop them, or drop off"
            )
        for key in values:
            if key == "batch_schedule" or key not in names:
                fix = (
                    "an entry cannot hold a schedule"
                    if key == "batch_schedule"
                    else settings.foreign_setting(key, values[key])
                )
                raise ValueError(f"{where}: {fix}")
        changes = {k: _typed(type(names[k].default), v) for k, v in values.items()}
        try:  # the settings' own checks (gamma >= 1, a kind's limits), on this entry's
            dataclasses.replace(settings, batch_schedule=[], **changes)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        checked.append({"batch_size": size, **({"off": True} if off else changes)})
    return checked


def _typed(kind: type, value: Any) -> Any:
    """`value` as a `kind` (int, float, bool or str) where it is that value written as text (a
    config file's or a command line's) or an int for a float; anything else as it is, for the
    checks that follow to name."""
    if isinstance(value, str) and kind is bool:
        return {"true": True, "false": False}.get(value.strip().lower(), value)
    if isinstance(value, str) and kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value
