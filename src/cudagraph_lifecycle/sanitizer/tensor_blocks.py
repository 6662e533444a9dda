"""Which of a pool's live blocks a tensor's storage lies in, and a tensor as a pin names it."""

from __future__ import annotations

import torch

from ..backends import Backend


def blocks_of(backend: Backend, t: torch.Tensor, blocks: list[tuple]) -> list[int]:
    span = backend.storage_span(t)
    if span is None:
        return []
    lo, hi = span
    return [i for i, (blo, bhi, _, _) in enumerate(blocks) if lo < bhi and blo < max(hi, lo + 1)]


def shape_of(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
