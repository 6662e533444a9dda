"""Which allocations land in a graph's private pool when an engine captures on a stream of its own, in a
fresh process: plain PyTorch, after the cycle's prewarm, and under the observation layer. Each case runs in a
subprocess (a process's first capture is what differs); each block left in a private pool is printed with the
allocation's innermost frames (C++ included), so a workspace names the library that made it.

    python scripts/probes/workspace_in_pool.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = ("plain", "prewarm", "observed", "prewarm_backward")

CHILD = r'''
import json, sys, torch
case = sys.argv[1]
if case in ("prewarm", "prewarm_backward"):
    from cudagraph_lifecycle.backends import get_backend
    get_backend("cuda").prewarm(0, backward=case == "prewarm_backward")
if case == "observed":
    from cudagraph_lifecycle import observe
    observe.acquire()
torch.cuda.memory._record_memory_history(max_entries=100000, stacks="all")
dev = torch.device("cuda", 0)
ws = [(torch.randn(256, 256, device=dev) * 0.06, torch.randn(256, device=dev)) for _ in range(3)]
def fwd(x):
    for w, b in ws:
        x = torch.relu(torch.addmm(b, x, w))
    return x
out = []
for engine in range(2):
    s = torch.cuda.Stream()
    x = torch.zeros(8, 256, device=dev)
    with torch.cuda.stream(s), torch.no_grad():
        fwd(x)  # warm-up on the capture stream, as the engines do
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    with torch.no_grad(), torch.cuda.graph(g, pool=pool, stream=s):
        y = fwd(x)
    snap = torch.cuda.memory._snapshot()
    for seg in snap["segments"]:
        if tuple(seg.get("segment_pool_id", (0, 0))) != tuple(pool):
            continue
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            frames = [f"{f['name']} ({f['filename'].rsplit('/', 1)[-1]}:{f['line']})" for f in blk.get("frames", [])]
            keep = [f for f in frames if "blas" in f.lower() or "workspace" in f.lower()][:4] or frames[:6]
            out.append({"engine": engine, "pool": list(pool), "size": blk["size"], "frames": keep})
    del g, y
print(json.dumps(out))
'''


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    found = {}
    for case in CASES:
        r = subprocess.run([sys.executable, "-c", CHILD, case], capture_output=True, text=True, timeout=300)
        if r.returncode:
            found[case] = {"error": r.stderr[-2000:]}
            continue
        found[case] = json.loads(r.stdout.strip().splitlines()[-1])
    for case, blocks in found.items():
        print(f"== {case}")
        if isinstance(blocks, dict):
            print(blocks["error"])
            continue
        for b in blocks:
            print(f"  engine {b['engine']} pool {b['pool']}: {b['size'] / 2**20:.2f} MiB  <- {' | '.join(b['frames'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
