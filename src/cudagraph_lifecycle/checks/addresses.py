"""Captured addresses: a graph reads its weights, static inputs and caches at the addresses they had when
it was captured. Reloading weights (RL weight sync, a LoRA swap, sleep/wake) into new tensors leaves the graph
reading the old memory, freed or stale, and the output is silently wrong. The runner's checked capture records
what each graph read from outside its pool (``capture_watch.py``); :class:`AddressBook` says which of those
storages died or moved since, by parameter or buffer name where names were given."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .capture_watch import ReadStorage


def named_tensors(names: Any) -> dict[str, torch.Tensor]:
    """``names``: a module (its parameters and buffers), a mapping or pairs of name -> tensor, or None."""
    if names is None:
        return {}
    if isinstance(names, torch.nn.Module):
        return dict(names.named_parameters()) | dict(names.named_buffers())
    items = names.items() if isinstance(names, Mapping) else names
    return {str(k): v for k, v in items if isinstance(v, torch.Tensor)}


@dataclass
class AddressBook:
    """For every graph: the storages it read at capture, and the names they had then."""

    reads: dict[str, dict[int, ReadStorage]] = field(default_factory=dict)  # graph -> storage key -> read
    names: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (storage key, address) at capture

    def add(self, graph: str, reads: dict[int, ReadStorage], names: Mapping[str, torch.Tensor]) -> None:
        self.reads[graph] = dict(reads)
        for name, t in names.items():
            if name in self.names:  # its first capture's storage and address stand
                continue
            st = t.untyped_storage()
            if st._cdata in reads:
                self.names[name] = (st._cdata, st.data_ptr())

    def problems(self, names: Mapping[str, torch.Tensor]) -> list[str]:
        """Each captured storage that died or moved: what, where it was, where it is, the graphs reading it."""
        out = []
        readers: dict[int, list[str]] = {}
        for graph, reads in self.reads.items():
            for key in reads:
                readers.setdefault(key, []).append(graph)
        seen = set()
        for name, (key, old) in sorted(self.names.items()):
            now = names.get(name)
            if now is None:
                continue
            new = now.untyped_storage().data_ptr()
            if new != old:
                seen.add(key)
                out.append(f"{name}: captured at {old:#x}, now at {new:#x} (read by {', '.join(readers.get(key, []))}): "
                           "the graphs still read the old address; copy new weights in place "
                           "(param.data.copy_(new)) or capture again")
        label = {key: name for name, (key, _) in self.names.items()}
        for key, graphs in readers.items():
            read = next(r[key] for r in self.reads.values() if key in r)
            if key in seen:
                continue
            if read.ref.expired():
                what = label.get(key, f"a {read.nbytes}-byte storage read by {read.op}")
                out.append(f"{what}: freed since the capture (was at {read.address:#x}, read by {', '.join(graphs)}): "
                           "the graphs read freed memory")
        return out
