"""What the installed plugin costs a session that does not use it: a one-test session with the plugin
auto-loaded against the same session with ``-p no:cudagraph``, paired and interleaved in one run.

    python bench/bench_plugin_import.py [--rounds 20] [--json PATH]

Each session's CPU time (user + system) and peak memory are read from the kernel's accounting of that
child (``os.wait4``). Bytecode is cached, as on any install. Target (issue 12): the median of the per-round CPU-time ratios <= 1.15.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.common import emit  # noqa: E402


def session(folder: str, *extra: str) -> tuple[float, float]:
    """(CPU seconds, peak RSS in MiB) of one ``pytest -q`` session in ``folder``."""
    # Bytecode is cached as on any install (PYTHONDONTWRITEBYTECODE, set on some CI images, would make every
    # loaded session compile the plugin's sources and measure the compiler instead).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CUDAGRAPH_", "PYTEST_")) and k != "PYTHONDONTWRITEBYTECODE"}
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra], cwd=folder,
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"pytest {' '.join(extra)} exited {p.returncode} in {folder}")
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "test_one.py"), "w") as f:
            f.write("def test_one():\n    assert 1 + 1 == 2\n")
        session(folder), session(folder, "-p", "no:cudagraph")  # warm the file and bytecode caches
        loaded, disabled, ratios = [], [], []
        for i in range(a.rounds):  # ABBA: neither side always runs first
            pair = [("loaded", ()), ("disabled", ("-p", "no:cudagraph"))]
            got = dict((name, session(folder, *extra)) for name, extra in (pair if i % 2 == 0 else pair[::-1]))
            loaded.append(got["loaded"])
            disabled.append(got["disabled"])
            ratios.append(got["loaded"][0] / got["disabled"][0])
    out = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0],
                 "cpus": os.cpu_count()},
        "rounds": a.rounds,
        "cpu_s_loaded": statistics.median(c for c, _ in loaded),
        "cpu_s_disabled": statistics.median(c for c, _ in disabled),
        "rss_mib_loaded": statistics.median(m for _, m in loaded),
        "rss_mib_disabled": statistics.median(m for _, m in disabled),
        "cpu_ratio": statistics.median(ratios),
        "cpu_ratio_spread": [min(ratios), max(ratios)],
        "target": 1.15,
    }
    out["pass"] = out["cpu_ratio"] <= out["target"]
    emit(out, a.json)


if __name__ == "__main__":
    main()
