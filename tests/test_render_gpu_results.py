"""The GPU results page (scripts/render_gpu_results.py): a partial latest run is shown first, and an earlier
run only for the result files the latest does not have."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(folder, summary: str, files: dict) -> str:
    folder.mkdir()
    (folder / "summary.md").write_text(summary)
    for name, data in files.items():
        (folder / name).write_text(json.dumps(data))
    return str(folder)


def _worker(ratio: float) -> dict:
    return {"call": {"ratio": ratio, "worker_call_us": 40.0, "bare_pipe_roundtrip_us": 44.0},
            "start": {"ratio": 1.2, "worker_ready_ms": 7.8, "bare_fork_first_result_ms": 6.5},
            "per_engine": {"ratio": 448.0, "fresh_process_s": 5.2, "reused_worker_s": 0.012}}


def test_an_earlier_run_shows_only_what_the_latest_did_not_run(tmp_path):
    latest = _run(tmp_path / "run31", "# GPU check\n- commit: new\n", {"bench-worker.json": _worker(0.92)})
    earlier = _run(tmp_path / "run30", "# GPU check\n- commit: old\n", {
        "bench-worker.json": _worker(0.77),
        "bench-mpi.json": {"per_engine": {"ratio": 60.0, "fresh_mpirun_s": 3.0, "reused_rank_s": 0.05}}})
    page = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "render_gpu_results.py"), latest, earlier],
                          capture_output=True, text=True, check=True).stdout
    head, _, older = page.partition("## run30: the steps run31 did not run")
    assert "- commit: new" in head and "0.92 (40 vs 44 µs)" in head and "fresh mpirun" not in head
    assert "- commit: old" in older and "fresh mpirun / reused rank (2 ranks) | 60×" in older
    assert "0.77" not in page, "the earlier run's worker figure is shown though the latest has one"
    assert "\n### Benchmarks" in older and "\n## Benchmarks" in head, "the earlier run's headings are not one level down"
