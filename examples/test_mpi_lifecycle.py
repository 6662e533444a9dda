"""The same engine sequences on real reused MPI ranks (mpi4py.futures MPIPoolExecutor), the way
TensorRT-LLM deploys engines: skipped without mpi4py and an MPI runtime."""

import pytest
from engines import make_mlp_engine


@pytest.mark.mpi
@pytest.mark.cudagraph
@pytest.mark.cudagraph_engines(3, ranks=2)
def test_each_rank_gets_a_fresh_pool_per_engine(engine_sequence):
    records = engine_sequence(make_mlp_engine)
    assert len(records) == 3 * 2 and all(r["verdict"] == "held" and not r["failed"] for r in records)
    by_rank = {}
    for r in records:
        by_rank.setdefault(r["rank"], []).append(r)
    assert sorted(by_rank) == [0, 1]
    for recs in by_rank.values():
        assert len({r["pid"] for r in recs}) == 1  # one reused rank held all its engines
        assert len({tuple(r["pool_ids"][0][1]) for r in recs}) == 3  # a fresh pool each time
