"""Shared by the benchmarks and probes: print the results and write them as JSON; pools left pinned."""

import json


def emit(out: dict, path: str | None) -> None:
    print(json.dumps(out, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def pinned_pools(be, stream, x, n: int) -> list:
    """``n`` graph pools captured under a sanitizer (so its ledger knows them), released, and pinned by their
    outputs: the returned tensors. Dead pools that every later capture is judged against."""
    from cudagraph_lifecycle import PoolSanitizer

    kept = []
    with PoolSanitizer(be):
        for _ in range(n):
            g = be.new_graph()
            with be.graph(g, pool=be.graph_pool_handle(), stream=stream):
                y = x * 2
            g.reset()
            kept.append(y)
            del g, y
    return kept
