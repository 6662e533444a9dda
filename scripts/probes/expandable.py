"""Probe: which teardown orders crash plain PyTorch under expandable_segments:True. Each order runs in a fresh
process: a capture allocates an optional large block, then N blocks of one size; a subset is kept alive across
the pool's teardown and freed afterwards. A grid first, then the crashing rows again: repeated, without
expandable segments, in other orders, and under the sanitizer (on: the hazard is recorded; strict: the reset
is refused and the fix -- free first, then reset -- survives).
  run on the GPU: python3 scripts/probes/expandable.py [--jobs 12]   (writes $OUT/expandable-probe.json)"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

CHILD = r"""
import gc, sys
import torch
body, keep, order = sys.argv[1], sys.argv[2], sys.argv[3]
def p(*a): print(*a, flush=True)
def A(b): return torch.empty(b, dtype=torch.uint8, device="cuda")
if order in ("sanitized", "strict"):
    from cudagraph_lifecycle.ledger import ledger
A(1)
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    A(4) * 2
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
ns = {"A": A, "MiB": 1 << 20}
h = torch.cuda.graph_pool_handle()
with torch.cuda.graph(g, pool=h, stream=s):
    exec(body, ns)
p("captured")
kept = eval(keep, ns)
ns.clear()
if order in ("reset_empty_free", "sanitized"):
    g.reset(); p("reset")
    if order == "sanitized":
        p("hazards", len(ledger.hazards), [h.live_bytes for h in ledger.hazards])
    torch.cuda.empty_cache(); p("emptied")
    del kept; p("freed")
elif order == "strict":
    try:
        g.reset(); p("reset went through")
    except Exception as e:
        p("refused", type(e).__name__)
    del kept; p("freed first")
    g.reset(); torch.cuda.empty_cache(); p("then reset")
elif order == "del_empty_free":
    del g; gc.collect(); p("destroyed")
    torch.cuda.empty_cache(); p("emptied")
    del kept; p("freed")
elif order == "reset_free_empty":
    g.reset(); p("reset")
    del kept; p("freed")
    torch.cuda.empty_cache(); p("emptied")
elif order == "recapture":  # everything freed: is the pool erased, or a zombie that asserts on reuse?
    g.reset(); del kept; torch.cuda.synchronize(); torch.cuda.empty_cache(); torch._C._host_emptyCache()
    segs = [x for x in torch.cuda.memory_snapshot() if tuple(x["segment_pool_id"]) == tuple(h)]
    p("segments left", len(segs))
    g3 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g3, pool=h, stream=s):
            w = A(1 << 20)
        p("recapture ok")
    except RuntimeError as e:
        p("recapture failed", str(e).splitlines()[0][:100])
elif order == "reset_capture2_free":
    g.reset(); p("reset")
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, stream=s):
        w = A(1 << 20)
    p("second capture")
    del kept; p("freed")
torch.cuda.synchronize(); p("synced")
torch.cuda.empty_cache(); p("emptied again")
z = [A(n) for n in (128, 1 << 18, 1 << 21, 10 << 20, 50 << 20)]
torch.cuda.synchronize()
p("survived")
"""


def run(row: dict) -> dict:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=row.get("conf", "expandable_segments:True"))
    if row["order"] == "sanitized":
        env["CUDAGRAPH_SANITIZE"] = "1"
    if row["order"] == "strict":
        env["CUDAGRAPH_SANITIZE"] = "strict"
    args = [row["body"], row["keep"], row["order"]]
    if row["order"] in ("sanitized", "strict"):
        code = "import cudagraph_lifecycle\n" + CHILD
    else:
        code = CHILD
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, env=env)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired:
        rc, out, err = "timeout", "", ""
    last_err = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("frame #")][-2:]
    return {**row, "rc": rc, "steps": out.split("\n")[-8:], "err": last_err, "s": round(time.time() - t0, 1)}


# Recipes from reading the allocator (docs/ARCHITECTURE.md): C* predicted to crash, N* predicted not to.
RECIPES = {
    "C1 big temp, 20 x 2M, keep alt": ("b = A(100 * MiB); del b; xs = [A(2 * MiB) for _ in range(20)]", "xs[0::2]"),
    "C2 big temp, 10 x 20M, keep alt": ("b = A(200 * MiB); del b; xs = [A(20 * MiB) for _ in range(10)]", "xs[0::2]"),
    "C3 big temp, one 10M output": ("b = A(100 * MiB); del b; o = A(10 * MiB)", "[o]"),
    "C4 small temp, big temp, 20 x 2M": ("t = A(4096); del t; b = A(100 * MiB); del b; "
                                         "xs = [A(2 * MiB) for _ in range(20)]", "xs[0::2]"),
    "C5 90M kept to end, 5 x 2M": ("L = A(90 * MiB); xs = [A(2 * MiB) for _ in range(5)]", "xs[0::2]"),
    "C6 big temp, 3 x 20M, 3 x 1M": ("b = A(100 * MiB); del b; x, y, z = [A(20 * MiB) for _ in range(3)]; "
                                     "sm = [A(MiB) for _ in range(3)]", "[x, z, *sm]"),
    "N2 20 x 2M, keep alt": ("xs = [A(2 * MiB) for _ in range(20)]", "xs[0::2]"),
    "N3 C1 + a kept small": ("b = A(100 * MiB); del b; xs = [A(2 * MiB) for _ in range(20)]; k = A(4096)",
                             "xs[0::2] + [k]"),
    "N4 one 10M output, no temp": ("o = A(10 * MiB)", "[o]"),
}


def grid() -> list[dict]:
    rows = [{"name": name, "body": body, "keep": keep, "order": "reset_empty_free"}
            for name, (body, keep) in RECIPES.items()]
    for name in ("N2 20 x 2M, keep alt", "N4 one 10M output, no temp", "C1 big temp, 20 x 2M, keep alt"):
        rows.append({"name": f"Z {name[:2]} all freed, recapture same id", "body": RECIPES[name][0],
                     "keep": RECIPES[name][1], "order": "recapture"})
        rows.append({"name": f"Z {name[:2]} all freed, recapture same id, no expandable", "body": RECIPES[name][0],
                     "keep": RECIPES[name][1], "order": "recapture", "conf": ""})
    rows.append({"name": "N1 = C1 freed before empty_cache", "body": RECIPES["C1 big temp, 20 x 2M, keep alt"][0],
                 "keep": "xs[0::2]", "order": "reset_free_empty"})
    for large, n, size, inside in itertools.product((64, 100, 256), (8, 20, 64), (2, 20), (True, False)):
        body = (f"b = A({large} * MiB); " + ("del b; " if inside else "")
                + f"xs = [A({size} * MiB) for _ in range({n})]")
        for keep in ("xs[0::2]", "xs[-1:]"):
            rows.append({"name": f"grid {large}M{' temp' if inside else ''} + {n} x {size}M keep {keep}",
                         "body": body, "keep": keep, "order": "reset_empty_free"})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--follow", type=int, default=4, help="crashing rows to study further")
    a = ap.parse_args()
    t0 = time.time()
    with ThreadPoolExecutor(a.jobs) as ex:
        first = list(ex.map(run, grid()))
    for r in first:
        print(f"{r['name']:<52} rc={r['rc']} {r['steps'][-3:]} {r['err'][-1:] if r['rc'] else ''}", flush=True)
    crashed = [r for r in first if r["rc"] != 0]
    # the recipes first, then the grid's crashing rows
    study = sorted(crashed, key=lambda r: not r["name"].startswith("C"))[: a.follow]
    follow = []
    for r in study:
        base = {k: r[k] for k in ("name", "body", "keep")}
        follow += [{**base, "order": "reset_empty_free", "repeat": i} for i in range(2)]
        follow.append({**base, "order": "reset_empty_free", "conf": ""})
        follow += [{**base, "order": o} for o in ("del_empty_free", "reset_free_empty", "reset_capture2_free",
                                                   "sanitized", "strict")]
    with ThreadPoolExecutor(a.jobs) as ex:
        second = list(ex.map(run, follow))
    print("--- follow-up of the crashing rows")
    for r in second:
        print(f"{r['name'][:40]:<40} {r['order']:<20} conf={r.get('conf', 'expandable')!r:<12} rc={r['rc']} "
              f"{r['steps'][-3:]} {r['err'][-1:] if r['rc'] else ''}", flush=True)
    print(f"{len(crashed)}/{len(first)} grid rows crashed; {time.time() - t0:.0f} s")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "expandable-probe.json"), "w") as f:
        json.dump({"grid": first, "follow": second}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
