"""Real-model engines: a Hugging Face ``transformers`` Llama, small and with random weights (nothing is
downloaded), decoding one token for a batch of sequences from a static KV cache, captured into CUDA graphs the
ways inference code does it today. Test material for ``test_real_model.py``.

What makes them awkward, as real engines are: token-id inputs (int64) that an embedding indexes with; a
static KV cache per batch size, prefilled eagerly and written in place by every step (transformers 5 also
counts the cache's length on the device, in place, each step: a step is not idempotent, so ``run`` and ``eager``
rewind it first; transformers 5.17 to 5.39, the ``hf`` extra's range); the model library's own attention and matmuls (cuBLAS workspaces on whatever stream runs
them); weights and caches in the default pool; no engine tells its pools.

Styles (``STYLES``):

* ``pool``: a hand-captured decode step, as a user first writes one: warm up eagerly on the default stream,
  then ``torch.cuda.graph(g, pool=...)`` (its own capture stream, where no matmul ran yet), a fresh pool
  handle per engine shared by its batch sizes;
* ``class``: the same, the pool handle kept on the engine's class (the bug this project exists for);
* ``global``: the pieces of every batch size in one process-wide pool, minted once (vLLM's global pool);
* ``stream``: a fresh pool per engine, warmed up and captured on a stream the engine makes itself;
* ``inference``: ``pool`` made, captured and run under ``torch.inference_mode()`` (vLLM's way);
* ``runner``: this library's ``CUDAGraphRunner`` around the model's decode step (token ids padded);
* ``compile``: ``torch.compile(mode="reduce-overhead")`` of the decode step (cudagraph trees; ``cuda`` only).

All but ``compile`` build their graphs through the ``Backend`` they are given, so they run on ``sim`` too.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from cudagraph_lifecycle.backends.base import Backend, PoolId
from cudagraph_lifecycle.errors import BackendUnavailableError

BATCH_SIZES = (1, 2, 4)
PROMPT = 6  # tokens prefilled before the decode step
MAX_CACHE = 16
VOCAB = 256
EXAMPLE_BATCH = 3  # served by the batch-4 graph: one padding row

_GLOBAL_POOL: PoolId | None = None  # ``global``: one handle for every engine of the process


def missing() -> str | None:
    """Why these engines cannot run here (transformers absent or too old), or None."""
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: F401
    except ImportError as e:
        return f"transformers is not installed ({e}): pip install -e '.[hf]' (transformers 5.17 to 5.39)"
    return None if hasattr(transformers, "__version__") else "transformers without a version"


def reset_module_state() -> None:
    """Forget the process-wide handles (between independent runs in one process)."""
    global _GLOBAL_POOL
    _GLOBAL_POOL = None
    ClassPoolEngine._pool = None


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _static_cache(cfg: Any) -> Any:
    from transformers import StaticCache

    return StaticCache(config=cfg, max_cache_len=MAX_CACHE)  # its tensors are made at the first update (the prefill)


class _Decoder:
    """The model, a static KV cache per batch size (prefilled eagerly), the static input buffer, and one
    decode step at position ``PROMPT`` for the first ``bs`` sequences."""

    def __init__(self, backend: Backend, seed: int = 0):
        from transformers import LlamaForCausalLM

        self.backend = backend
        self.device = backend.torch_device(0)
        self.dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        cpu_rng = torch.random.get_rng_state()
        torch.manual_seed(seed)  # random weights, the same in every engine and in plain PyTorch's run
        cfg = _config()
        with torch.device("cpu"):
            model = LlamaForCausalLM(cfg)
        torch.random.set_rng_state(cpu_rng)
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        forward = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward else "past_key_values"  # renamed in transformers 5.2x
        gen = torch.Generator().manual_seed(seed + 1)
        prompt = torch.randint(0, VOCAB, (max(BATCH_SIZES), PROMPT), generator=gen).to(self.device)
        self.ids = torch.zeros(max(BATCH_SIZES), 1, dtype=torch.long, device=self.device)  # the static input
        self.position = torch.tensor([PROMPT], device=self.device)
        self.caches: dict[int, Any] = {}
        with torch.no_grad():
            for bs in BATCH_SIZES:
                cache = _static_cache(cfg)
                self.model(input_ids=prompt[:bs], cache_position=torch.arange(PROMPT, device=self.device),
                           use_cache=True, **{self._cache_kw: cache})
                self.caches[bs] = cache

    def rewind(self, bs: int) -> None:
        """Back to position ``PROMPT``: transformers 5's static cache counts its length on the device and
        each step adds one in place."""
        for layer in getattr(self.caches[bs], "layers", ()):
            n = getattr(layer, "cumulative_length", None)
            if isinstance(n, torch.Tensor):
                n.fill_(PROMPT)

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """One decode step for ``ids`` (bs, 1), into the cache of batch size bs: the last position's logits."""
        bs = ids.shape[0]
        out = self.model(input_ids=ids, cache_position=self.position,
                         position_ids=self.position.view(1, 1).expand(bs, 1), use_cache=True,
                         **{self._cache_kw: self.caches[bs]})
        return out.logits[:, -1]

    def graph_size_for(self, b: int) -> int:
        return next(bs for bs in BATCH_SIZES if bs >= b)

    def example_input(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(7)
        return torch.randint(0, VOCAB, (EXAMPLE_BATCH, 1), generator=gen).to(self.device)

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        """What the graph computes, eagerly: the batch padded as the graph's, on the same cache, rewound."""
        b = x.shape[0]
        bs = self.graph_size_for(b)
        ids = torch.zeros(bs, 1, dtype=torch.long, device=self.device)
        ids[:b] = x
        self.rewind(bs)
        with torch.no_grad():
            return self.decode(ids)[:b].clone()


class _HandCaptured(_Decoder):
    """Graphs captured by hand, one per batch size (largest first), all into ``self._pool``."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self._pool: PoolId | None = None

    def _capture_stream(self) -> Any:
        return None  # torch.cuda.graph's own

    def _warm_up(self, bs: int, stream: Any) -> None:
        if stream is None:
            self.decode(self.ids[:bs])  # on the default stream, as a user's first try does
        else:
            with self.backend.stream(stream):
                self.decode(self.ids[:bs])
        self.backend.synchronize()

    def _capture_all(self, pool: PoolId) -> None:
        stream = self._capture_stream()
        with torch.no_grad():
            for bs in sorted(BATCH_SIZES, reverse=True):
                self.rewind(bs)
                self._warm_up(bs, stream)
                g = self.backend.new_graph()
                self.rewind(bs)
                with self.backend.graph(g, pool=pool, stream=stream):
                    out = self.decode(self.ids[:bs])
                self.graphs[bs] = (g, out)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        bs = self.graph_size_for(b)
        g, out = self.graphs[bs]
        self.ids[:b].copy_(x)
        self.ids[b:bs].fill_(0)
        self.rewind(bs)
        g.replay()
        return out[:b]

    def _reset_graphs(self) -> None:
        while self.graphs:
            self.graphs.popitem()[1][0].reset()


class PoolPerEngine(_HandCaptured):
    """``pool``: a fresh pool handle per engine."""

    def capture(self) -> None:
        self._pool = self.backend.graph_pool_handle()
        self._capture_all(self._pool)

    def release(self) -> None:
        self._reset_graphs()
        self._pool = None


class ClassPoolEngine(_HandCaptured):
    """``class``: the handle kept on the class, minted once, captured into by every engine."""

    _pool: PoolId | None = None

    def capture(self) -> None:
        if ClassPoolEngine._pool is None:
            ClassPoolEngine._pool = self.backend.graph_pool_handle()
        self._capture_all(ClassPoolEngine._pool)

    def release(self) -> None:
        self._reset_graphs()  # the class keeps the handle


class GlobalPoolEngine(_HandCaptured):
    """``global``: the pieces of every batch size of every engine in one process-wide pool."""

    def capture(self) -> None:
        global _GLOBAL_POOL
        if _GLOBAL_POOL is None:
            _GLOBAL_POOL = self.backend.graph_pool_handle()
        self._capture_all(_GLOBAL_POOL)

    def release(self) -> None:
        self._reset_graphs()


class OwnStreamEngine(PoolPerEngine):
    """``stream``: a fresh pool, warmed up and captured on a stream the engine makes (its cuBLAS workspace is
    made by the warm-up, in the default pool: growth, not a pool verdict)."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.stream = backend.new_stream(0)

    def _capture_stream(self) -> Any:
        return self.stream


class InferenceModeEngine(PoolPerEngine):
    """``inference``: ``pool`` the way vLLM's model runner works, all under ``torch.inference_mode()``: the
    model and its caches are made inside it (inference tensors, which may not be written outside it), and so
    are capture, steps and the eager reference. Nothing of ours may write one of its tensors outside."""

    def __init__(self, backend: Backend):
        with torch.inference_mode():
            super().__init__(backend)

    @torch.inference_mode()
    def capture(self) -> None:
        super().capture()

    @torch.inference_mode()
    def run(self, x: torch.Tensor) -> torch.Tensor:
        return super().run(x)

    @torch.inference_mode()
    def eager(self, x: torch.Tensor) -> torch.Tensor:
        return super().eager(x)


class RunnerEngine(_Decoder):
    """``runner``: the library's ``CUDAGraphRunner`` around the decode step, on token ids (int64), padded to
    the captured batch size; under ``--cudagraph-sanitize=strict`` in checked mode (the padding check poisons
    the padding rows of an integer input with the real rows' ids)."""

    def __init__(self, backend: Backend):
        super().__init__(backend)
        from cudagraph_lifecycle import CUDAGraphRunner

        self.runner = CUDAGraphRunner(self.decode, BATCH_SIZES, (1,), dtype=torch.long, backend=backend,
                                      name="hf-llama")

    def capture(self) -> None:
        with torch.no_grad():
            for bs in BATCH_SIZES:  # the runner's warm-ups are steps too
                self.rewind(bs)
            self.runner.capture()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        self.rewind(self.graph_size_for(x.shape[0]))
        return self.runner.run(x)

    def release(self) -> None:
        self.runner.release()


class CompiledEngine(_Decoder):
    """``compile``: the decode step under ``torch.compile(mode="reduce-overhead")`` (cudagraph trees), for
    the largest batch size only (a compile is costly); release resets dynamo, which frees the trees."""

    def __init__(self, backend: Backend):
        if backend.name != "cuda":
            raise BackendUnavailableError("the 'compile' real-model style runs torch.compile(mode='reduce-overhead') "
                                          "on CUDA only: run it on a GPU")
        super().__init__(backend)
        self._step = torch.compile(self.decode, mode="reduce-overhead", dynamic=False, fullgraph=False)

    def graph_size_for(self, b: int) -> int:
        return max(BATCH_SIZES)

    def capture(self) -> None:
        bs = max(BATCH_SIZES)
        with torch.no_grad():
            for _ in range(3):  # trees record at the first calls, then replay
                self.rewind(bs)
                self._step(self.ids[:bs])

    def run(self, x: torch.Tensor) -> torch.Tensor:
        b, bs = x.shape[0], max(BATCH_SIZES)
        self.ids[:b].copy_(x)
        self.ids[b:bs].fill_(0)
        self.rewind(bs)
        with torch.no_grad():
            return self._step(self.ids[:bs])[:b]

    def release(self) -> None:
        self._step = None
        torch._dynamo.reset()


STYLES = {"pool": PoolPerEngine, "class": ClassPoolEngine, "global": GlobalPoolEngine, "stream": OwnStreamEngine,
          "inference": InferenceModeEngine, "runner": RunnerEngine, "compile": CompiledEngine}
SIM_STYLES = ("pool", "class", "global", "stream", "inference", "runner")
