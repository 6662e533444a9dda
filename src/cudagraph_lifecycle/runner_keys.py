"""Which graph of a runner serves a batch, and the replay around it: the keys checked at build (batch sizes,
extra key fields, the input's feature shape), the input checked at each step, the smallest captured batch that
fits it, the input padded to that batch and the outputs sliced back; eager runs counted by reason.

``KeyedReplay`` is the runner's replay half (``CUDAGraphRunner`` derives from it): its methods are the
runner's own, so a step makes no call or lookup more than it would in one class.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import checks
from .errors import ConfigError, GraphInputError
from .trees import leaves, map_leaves

ExtraKey = tuple[tuple[str, Any], ...]


def _extra_key(extra: Mapping[str, Any], where: str = "extra key") -> ExtraKey:
    for name, value in extra.items():
        try:
            hash(value)
        except TypeError:
            raise ConfigError(
                f"{where} {name}={value!r} is a {type(value).__name__}, which cannot key a graph: use a hashable "
                "value (int, str, tuple)"
            ) from None
    return tuple(sorted(extra.items()))


def _unsliceable(out: Any, bs: int) -> ConfigError | None:
    """Outputs are sliced back to the batch along dim 0: one that has no batch dim cannot be."""
    for i, t in enumerate(t for t in leaves(out) if isinstance(t, torch.Tensor)):
        if t.dim() == 0 or t.shape[0] != bs:
            return ConfigError(
                f"forward returned output #{i} of shape {tuple(t.shape)} for a batch of {bs}: the runner slices "
                "outputs back to the batch along dim 0, so every output needs the batch as its first dim "
                "(return per-row values; reduce outside the graph)")
    return None


def validate_batch_sizes(batch_sizes: Iterable[int]) -> list[int]:
    try:
        sizes = list(batch_sizes)
    except TypeError:
        raise ConfigError(
            f"batch_sizes must be an iterable of positive ints, got {batch_sizes!r}: e.g. batch_sizes=[1, 2, 4, 8]"
        ) from None
    if not sizes:
        raise ConfigError("batch_sizes is empty: give at least one positive int, e.g. batch_sizes=[1, 2, 4, 8]")
    bad = [b for b in sizes if not isinstance(b, int) or isinstance(b, bool)]
    if bad:
        raise ConfigError(f"batch_sizes must be ints, got {bad!r}: convert them, e.g. [int(b) for b in sizes]")
    nonpos = [b for b in sizes if b <= 0]
    if nonpos:
        raise ConfigError(f"batch_sizes must be positive, got {nonpos!r}: drop sizes <= 0")
    dups = sorted({b for b in sizes if sizes.count(b) > 1})
    if dups:
        raise ConfigError(f"batch_sizes has duplicates {dups!r}: list each size once")
    return sorted(sizes)


def validate_feature_shape(feature_shape: Iterable[int]) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in feature_shape)
    except (TypeError, ValueError):
        raise ConfigError(f"feature_shape must be a tuple of ints, got {feature_shape!r}") from None
    if any(d <= 0 for d in shape):
        raise ConfigError(f"feature_shape must hold positive sizes, got {shape}")
    return shape


def validate_extra_keys(extra_keys: Iterable[Mapping[str, Any]] | None) -> list[ExtraKey]:
    extra = [{}] if extra_keys is None else [dict(e) for e in extra_keys]
    if not extra:
        raise ConfigError("extra_keys is empty: leave it None for no extra key fields, or give [{...}, ...]")
    keys = [_extra_key(e, f"extra_keys[{i}]") for i, e in enumerate(extra)]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"extra_keys has duplicates: {extra!r}")
    return keys


class KeyedReplay:
    """The runner's steps: which graph serves a batch and key, its replay with the input padded and the
    outputs sliced back, or an eager run counted by reason. The state is the runner's (``CUDAGraphRunner``
    sets it up, captures and releases)."""

    def _validate(self, x: torch.Tensor) -> int:
        if not isinstance(x, torch.Tensor):
            raise GraphInputError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 1 + len(self.feature_shape) or tuple(x.shape[1:]) != self.feature_shape:
            raise GraphInputError(
                f"input shape {tuple(x.shape)} does not fit runner {self.name!r}: expected (batch, "
                f"{', '.join(map(str, self.feature_shape))}); reshape the input or build the runner "
                f"with feature_shape={tuple(x.shape[1:])}"
            )
        if x.shape[0] == 0:
            raise GraphInputError("input batch is 0: skip the step, a graph cannot run an empty batch")
        if x.dtype != self.dtype:
            raise GraphInputError(f"input dtype {x.dtype} != runner dtype {self.dtype}: cast with x.to({self.dtype})")
        dev = self.backend.torch_device(self.device)
        if x.device.type != dev.type or (dev.index is not None and x.device.index != dev.index):
            raise GraphInputError(f"input on {x.device}, runner on {dev}: move it with x.to('{dev}')")
        return int(x.shape[0])

    def _eager(self, x: torch.Tensor, kwargs: dict, reason: str) -> Any:
        self._fallbacks[reason] += 1
        with torch.no_grad():
            return self.forward(x, **kwargs)

    def graph_size_for(self, batch: int) -> int | None:
        """The captured batch size that serves ``batch`` (smallest >= batch), or None if it is too large."""
        i = bisect.bisect_left(self.batch_sizes, batch)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def run(self, x: torch.Tensor, **extra: Any) -> Any:
        """One step: replay the graph for ``x``'s batch and key, or fall back to eager (counted by reason)."""
        self._check_live()
        b = self._validate(x)
        if not self.enabled:
            return self._eager(x, extra, "disabled")
        if not self._captured:
            self.capture()
        try:
            ekey = _extra_key(extra, "run() keyword")
        except ConfigError as e:
            raise GraphInputError(str(e)) from None
        if ekey in self._failed:
            return self._eager(x, extra, "capture_failed")
        if ekey not in self.extra_keys:
            return self._eager(x, extra, "key_not_captured")
        bs = self.graph_size_for(b)
        if bs is None:
            return self._eager(x, extra, "batch_over_max")
        graph, out = self._graphs[(bs, ekey)]
        self._static_in[:b].copy_(x)
        if self._guard is not None:
            self._guard.replaying((bs, ekey))
        if self._poison and self._due((bs, ekey, b)):
            checks.checked_replay(graph, self._static_in, b, bs, out, self.pad_value,
                                  f"runner {self.name!r}, batch {b} on the batch-{bs} graph",
                                  *self._effects.get((bs, ekey), (None, None)))
        else:
            if b < bs:
                self._static_in[b:bs].fill_(self.pad_value)
            graph.replay()
        self._stats.replays += 1
        if self.copy_outputs:
            return map_leaves(lambda t: t[:b].clone() if isinstance(t, torch.Tensor) else t, out)
        if self._guard is not None:
            # a view of state the graph writes in place (a KV cache handed back) changes at each step eagerly
            # too: only the graph's own buffers are guarded
            guard, key, state = self._guard, (bs, ekey), self._effects.get((bs, ekey), (None, frozenset()))[1]
            return map_leaves(lambda t: t if not isinstance(t, torch.Tensor) else t[:b]
                              if state and checks.storage_key(t) in state else guard.hand_out(key, t[:b]), out)
        return map_leaves(lambda t: t[:b] if isinstance(t, torch.Tensor) else t, out)

    __call__ = run

    def _due(self, key: tuple) -> bool:
        """Is this replay of (graph, real batch) one the padding check proves? Its first, then every
        ``recheck_every``-th: a pair's padding behaviour is a property of the captured ops, so proving every
        replay would double the step for what the first proof already showed."""
        n = self._replays_of[key]
        self._replays_of[key] = n + 1
        return n % self.recheck_every == 0

    @property
    def keys(self) -> list[tuple[int, dict]]:
        return [(bs, dict(ekey)) for bs, ekey in self._graphs]
