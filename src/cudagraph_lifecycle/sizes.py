"""Sizes in bytes as users write them ("64MiB", "1.5 GB", 4096) and read them back in messages."""

from __future__ import annotations

import re

# binary units are what the allocator rounds to; decimal ones are what a data sheet says
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
SIZE_HELP = ("a whole number of bytes, optionally with KiB, MiB or GiB (KB, MB, GB are powers of 10; 1.5GiB "
             "where it comes to whole bytes)")
_SIZE = re.compile(r"\s*(-?)\s*(\d+)(?:\.(\d+))?\s*([a-zA-Z]*)\s*", re.ASCII)


class NegativeSizeError(ValueError):
    """A size written with a minus sign: a budget or a limit cannot be below 0."""


def parse_size(text: str | int) -> int:
    """Bytes from ``text``: exact (integers are not rounded through a float), a whole number of bytes.
    ``ValueError`` when it is not a size, :class:`NegativeSizeError` when it has a minus sign."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise NegativeSizeError(text)
        return text
    m = _SIZE.fullmatch(str(text))
    if m is None or m.group(4).lower() not in UNITS:
        raise ValueError(text)
    if m.group(1):
        raise NegativeSizeError(text)
    unit, fraction = UNITS[m.group(4).lower()], m.group(3) or ""
    part, rest = divmod(int(fraction or 0) * unit, 10 ** len(fraction))  # integers: exact at any length
    if rest:
        raise ValueError(text)  # a fraction of a byte
    return int(m.group(2)) * unit + part


def size_text(n: int) -> str:
    """``n`` bytes for a message: "64 MiB (67108864 bytes)", "512 bytes"; exact bytes kept beside a unit,
    the unit chosen after rounding (never "1024 KiB")."""
    units = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
    i = next((i for i, (_, scale) in enumerate(units) if abs(n) >= scale), None)
    if i is None:
        return f"{n} byte{'' if abs(n) == 1 else 's'}"
    if i > 0 and round(abs(n) / units[i][1], 2) >= 1024:  # 1048575 bytes: 1 MiB, not 1024 KiB
        i -= 1
    number = f"{round(abs(n) / units[i][1], 2):.2f}".rstrip("0").rstrip(".")
    return f"{'-' if n < 0 else ''}{number} {units[i][0]} ({n} bytes)"
