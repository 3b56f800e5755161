"""Memory sizes as people write them: ``24GiB``, ``512 MiB``, ``32GB``, ``1073741824``.

One parser serves every entry point (the planner's CLI, the trainer's ``--memory-budget``), so a
size means the same everywhere. Binary units (KiB, MiB, GiB, TiB) are powers of 1024. Decimal units
(KB, MB, GB, TB) are powers of 1000, as on a GPU's spec sheet.
"""
from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in ``text``; a bare number is bytes. Raises ValueError with a one-line message."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"memory size must not be negative, got {text}")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(
            f"bad memory size {text!r}; write a number with a unit, e.g. 24GiB, 512MiB, 32GB"
        )
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower() or "b")
    if factor is None:
        raise ValueError(
            f"bad memory size {text!r}: unknown unit {unit!r}; "
            f"use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
        )
    return int(round(float(number) * factor))


def format_size(num_bytes: float) -> str:
    """A short binary-unit rendering, e.g. ``1.50 GiB``; negative sizes keep their sign."""
    sign = "-" if num_bytes < 0 else ""
    value = abs(float(num_bytes))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
