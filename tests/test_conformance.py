"""The conformance table as tests: each scenario's outcome on the chosen backend must equal its expectation.

CI runs them on ``sim``; the GPU check runs the same table on ``cuda`` (CUDAGRAPH_CONFORMANCE_BACKEND=cuda),
each scenario in a fresh process because the allocator's assert poisons the process.
"""

import os

import pytest

from cudagraph_lifecycle.conformance import SCENARIOS, run_isolated, run_one, run_scenario

BACKEND = os.environ.get("CUDAGRAPH_CONFORMANCE_BACKEND", "sim")


def test_table_has_at_least_30_scenarios():
    assert len(SCENARIOS) >= 30
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[f"conformance-{s.name}" for s in SCENARIOS])
def test_conformance(scenario):
    if BACKEND == "sim":
        got = run_one(scenario.name, "sim")
    else:
        pytest.importorskip("torch").cuda.is_available() or pytest.skip("no GPU")
        got = run_isolated(scenario.name, BACKEND)
    assert got == scenario.expected


def test_isolated_run_matches_in_process_on_sim():
    name = "stale_handle_output_alive"
    assert run_isolated(name, "sim") == run_scenario(name, "sim") == "assert"


def test_the_conformance_command_without_a_gpu_says_so_in_one_line(capsys):
    import torch

    from cudagraph_lifecycle.conformance import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --backend cuda is available here")
    assert main(["--backend", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conformance: --backend cuda: ") and "choose backend 'sim'" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
