"""Bodies of the GPU tests. They run inside a reused worker, so the pytest process never initializes CUDA
(and stays able to fork), and an allocator assert poisons only the worker."""

import torch

from cudagraph_lifecycle import CUDAGraphRunner, LazyPool, get_backend


def runner_replay_and_release():
    be = get_backend("cuda")
    torch.manual_seed(0)
    lin = [torch.nn.Linear(128, 128).cuda() for _ in range(4)]

    def fwd(x):
        for m in lin:
            x = torch.relu(m(x))
        return x

    r = CUDAGraphRunner(fwd, [1, 2, 4, 8, 16], (128,), backend=be)
    errs = []
    for b in (1, 3, 8, 13):
        x = torch.randn(b, 128, device="cuda")
        with torch.no_grad():
            errs.append(float((r.run(x) - fwd(x)).abs().max()))
    (dev, pid), = r.pool_ids
    held = be.pool_state(pid).reserved_bytes
    rep = r.release()
    return {"errs": errs, "held": held, "clean": rep.clean, "in_snapshot": pid in be.pool_ids(),
            "captures": r.stats.captures}


def runner_capture_failure():
    be = get_backend("cuda")

    def fwd(x):
        if x.sum().item() > -1e30:  # host sync: illegal during capture
            return x * 2

    r = CUDAGraphRunner(fwd, [1, 2, 4], (64,), backend=be)
    x = torch.randn(3, 64, device="cuda")
    ok = torch.allclose(r.run(x), x * 2)
    st = r.stats
    rep = r.release()
    return {"fallback_ok": ok, "fallbacks": st.fallbacks, "failures": st.failures, "clean": rep.clean,
            "pools": [s.as_dict() for s in rep.pools]}


def lazy_pool_mempool_use_count():
    be = get_backend("cuda")
    lp = LazyPool(be)
    pid = lp.acquire(0)
    counts = [lp.use_count(0)]
    lp.retire()
    return {"mode": lp.mode, "counts": counts, "exists_after": be.pool_state(pid).exists}


def naive_two_engines():
    import sys

    sys.path.insert(0, "examples")
    from engines import make_naive_engine

    from cudagraph_lifecycle.cycle import run_cycle

    first = run_cycle(make_naive_engine, "cuda", 0).fresh
    try:
        run_cycle(make_naive_engine, "cuda", 1)
    except RuntimeError as e:
        return {"first_fresh": first, "second": str(e).splitlines()[0]}
    return {"first_fresh": first, "second": "no error"}
