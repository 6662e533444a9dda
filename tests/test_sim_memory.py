"""The simulated allocator's graph-memory figures against the committed H200 measurements.

bench/bench_runner.py measures the bytes of the graphs' pools for 8 batch sizes captured several ways; the
GPU check commits those figures (docs/gpu-results/<run>/bench-runner.json). The same captures on ``sim`` must
give the same pool bytes: block placement, splitting and segment sizes are part of what ``sim`` models.
Reserved-memory growth is not compared: ``sim`` keeps books of private graph pools only.
"""

import glob
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POOL_FIGURES = ("largest_alone_mib", "shared_largest_first_mib", "shared_smallest_first_mib", "separate_pools_mib")


def recorded_models():
    """(runs, model name, figures) from the committed GPU runs that recorded their models' parameters; runs
    with the same model and the same figures share one case (each costs a full simulated capture set)."""
    cases: dict[str, tuple[list[str], str, dict]] = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "gpu-results", "*", "bench-runner.json"))):
        mem = json.load(open(path)).get("memory", {})
        for name, fig in mem.items():
            if isinstance(fig, dict) and "sizes" in fig and "hidden" in fig:
                params = {k: fig.get(k) for k in ("sizes", "hidden", "ffn", "dtype", *POOL_FIGURES)}
                key = json.dumps([name, params], sort_keys=True)
                cases.setdefault(key, ([], name, fig))[0].append(os.path.basename(os.path.dirname(path)))
    return [("+".join(runs), name, fig) for runs, name, fig in cases.values()]


MODELS = recorded_models()


def test_some_gpu_run_recorded_its_models():
    assert MODELS, "no committed bench-runner.json with model parameters under docs/gpu-results"


@pytest.mark.parametrize("run,name,fig", MODELS, ids=[f"conformance-memory-{r}-{n}" for r, n, _ in MODELS])
def test_sim_pool_bytes_equal_the_h200(run, name, fig):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from bench_runner import memory_case
    finally:
        sys.path.pop(0)
    from cudagraph_lifecycle import get_backend

    model = {"hidden": fig["hidden"]}
    if fig.get("ffn"):
        model["ffn"] = fig["ffn"]
    if fig.get("dtype"):
        model["dtype"] = getattr(torch, fig["dtype"])
    if model.get("dtype", torch.float32).itemsize == 2:
        # The allocator sees byte sizes only: float32 at half the width gives every block the same bytes, at
        # a fraction of the CPU time of bf16 matrix products (about 40x slower than float32 on CI's CPUs).
        model = {k: v // 2 if k in ("hidden", "ffn") else v for k, v in model.items()} | {"dtype": torch.float32}
    got = memory_case(get_backend("sim"), fig["sizes"], **model)
    assert {k: got[k] for k in POOL_FIGURES} == {k: fig[k] for k in POOL_FIGURES}
