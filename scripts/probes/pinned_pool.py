"""Probe: what pins the pool of a process's first make_graphed_callables (and torch.compile reduce-overhead).
Each variant runs in a fresh process with allocation history (Python and C++ frames); after the engine is
dropped, every live block of a graph pool is printed with the frames that name its owner, then cuBLAS's
workspaces are cleared to see whether that frees the pool.
  run on the GPU: python3 scripts/probes/pinned_pool.py   (writes $OUT/pinned-probe.json)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import gc, json, sys
import torch
variant = sys.argv[1]
torch.cuda.memory._record_memory_history(max_entries=200000, context="all", stacks="all")
dev = torch.device("cuda")
def graph_pools():
    out = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        pid = tuple(seg["segment_pool_id"])
        if pid == (0, 0):
            continue
        e = out.setdefault(str(pid), {"reserved": 0, "live": []})
        e["reserved"] += seg["total_size"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                frames = b.get("frames") or []
                keep = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name'][:90]}" for f in frames
                        if any(k in f["name"] for k in ("Blas", "blas", "Workspace", "workspace", "cudnn", "Cudnn"))
                        or f["filename"].endswith(".py")][:14]
                e["live"].append({"size": b["size"], "stream": seg.get("stream"), "frames": keep})
    return out
if variant == "warm-capture-stream":
    g = torch.cuda.graph
    if g.default_capture_stream is None:
        g.default_capture_stream = torch.cuda.Stream()
    with torch.cuda.stream(g.default_capture_stream):
        a = torch.ones(64, 64, device=dev); a @ a
    torch.cuda.synchronize()
if variant == "prewarm":
    from cudagraph_lifecycle.backends import get_backend
    get_backend("cuda").prewarm(0)
ws0 = torch.cuda.memory_allocated()
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)).to(dev)
x = torch.randn(8, 1024, device=dev, requires_grad=True)
if variant == "compile":
    f = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):
            y = f(x.detach())
    del f
else:
    gm = torch.cuda.make_graphed_callables(model, (x,))
    y = gm(x)
    y.sum().backward()
    del gm
torch.cuda.synchronize()
before = graph_pools()
del y, model, x
gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
after = graph_pools()
torch._C._cuda_clearCublasWorkspaces()
torch.cuda.synchronize(); torch.cuda.empty_cache()
cleared = graph_pools()
print("@@" + json.dumps({"variant": variant, "torch": torch.__version__,
                         "before_release": {k: v["reserved"] for k, v in before.items()},
                         "after_release": after, "after_clear_cublas": {k: v["reserved"] for k, v in cleared.items()},
                         "default_capture_stream": str(torch.cuda.graph.default_capture_stream)}))
"""


def main() -> int:
    results = []
    for variant in ("plain", "warm-capture-stream", "prewarm", "compile"):
        r = subprocess.run([sys.executable, "-c", CHILD, variant], capture_output=True, text=True, timeout=300)
        if "@@" in r.stdout:
            res = json.loads(r.stdout.split("@@", 1)[1])
        else:
            res = {"variant": variant, "rc": r.returncode, "err": r.stderr.splitlines()[-5:]}
        results.append(res)
        print(json.dumps(res, indent=1)[:6000], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "pinned-probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
