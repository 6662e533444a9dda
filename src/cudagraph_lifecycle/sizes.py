"""Sizes in bytes as users write them ("64MiB", "1.5 GB", 4096) and read them back in messages."""

from __future__ import annotations

import re

# binary units are what the allocator rounds to; decimal ones are what a data sheet says
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
SIZE_HELP = "an integer, optionally with KiB, MiB or GiB (KB, MB, GB are powers of 10)"


class NegativeSizeError(ValueError):
    """A size written with a minus sign: a budget or a limit cannot be below 0."""


def parse_size(text: str | int) -> int:
    """Bytes from ``text``; ``ValueError`` when it is not a size, :class:`NegativeSizeError` when it is below 0."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise NegativeSizeError(text)
        return text
    m = re.fullmatch(r"\s*([-+]?)\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(3).lower() not in UNITS:
        raise ValueError(text)
    n = int(float(m.group(2)) * UNITS[m.group(3).lower()])
    if m.group(1) == "-" and n:
        raise NegativeSizeError(text)
    return n


def size_text(n: int) -> str:
    """``n`` bytes for a message: "64 MiB (67108864 bytes)", "512 bytes"; exact bytes kept beside a rounded unit."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit} ({n} bytes)"
    return f"{n} byte{'' if abs(n) == 1 else 's'}"
