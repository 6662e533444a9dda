"""Probe: which teardown orders crash plain PyTorch under expandable_segments:True, each in a fresh process,
with and without it (a block of a graph pool kept alive across the pool's teardown, then freed).
  run on the GPU: python3 scripts/probe_expandable.py   (writes $OUT/probe.json)"""
import json
import os
import subprocess
import sys

PRE = """
import torch, gc
def p(*a): print(*a, flush=True)
s = torch.cuda.Stream()
x = torch.ones(1 << 20, device="cuda")
with torch.cuda.stream(s):
    x * 2
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
"""
CAP1 = """
with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle(), stream=s):
    y = x * 2
p("captured")
"""
CAPN = """
with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle(), stream=s):
    ys = [torch.empty(n, device="cuda") for n in (128, 1 << 18, 1 << 21, 10 << 20)]
    for t in ys: t.fill_(1)
y = ys
p("captured")
"""
CAPOWN = """
with torch.cuda.graph(g, stream=s):
    ys = [torch.empty(n, device="cuda") for n in (128, 1 << 18, 1 << 21, 10 << 20)]
    for t in ys: t.fill_(1)
y = ys
p("captured")
"""
END = """
torch.cuda.synchronize(); torch.cuda.empty_cache()
z = [torch.ones(n, device="cuda") * 3 for n in (128, 1 << 18, 1 << 21, 10 << 20)]
torch.cuda.synchronize()
p("survived", torch.cuda.memory_reserved())
"""
V = {
  "A reset, del, empty_cache": PRE + CAP1 + "g.reset(); p('reset')\ndel y; p('freed')\n" + END,
  "B reset, empty_cache, del": PRE + CAP1 + "g.reset(); p('reset')\ntorch.cuda.empty_cache(); p('emptied')\ndel y; p('freed')\n" + END,
  "C reset, second capture, del": PRE + CAP1 + "g.reset(); p('reset')\ng2 = torch.cuda.CUDAGraph()\nwith torch.cuda.graph(g2, stream=s):\n    w = x + 1\np('second')\ndel y; p('freed')\n" + END,
  "D del g, empty_cache, del": PRE + CAP1 + "del g; gc.collect(); p('destroyed')\ntorch.cuda.empty_cache(); p('emptied')\ndel y; p('freed')\n" + END,
  "E many blocks: reset, empty_cache, del": PRE + CAPN + "g.reset(); p('reset')\ntorch.cuda.empty_cache(); p('emptied')\ndel y, ys; p('freed')\n" + END,
  "F own pool, many blocks: del g, empty_cache, del": PRE + CAPOWN + "del g; gc.collect(); p('destroyed')\ntorch.cuda.empty_cache(); p('emptied')\ndel y, ys; p('freed')\n" + END,
  "G many: reset, alloc new, empty_cache, del": PRE + CAPN + "g.reset(); p('reset')\nq = torch.ones(10 << 20, device='cuda'); torch.cuda.empty_cache(); p('emptied')\ndel y, ys; p('freed')\n" + END,
  "H many: reset, del half, empty_cache, del rest": PRE + CAPN + "g.reset(); p('reset')\ndel ys[0], ys[2]; torch.cuda.empty_cache(); p('half')\ndel y, ys; p('freed')\n" + END,
  "I mempool: del pool and g, del": PRE + "mp = torch.cuda.MemPool()\nwith torch.cuda.graph(g, pool=mp.id, stream=s):\n    ys = [torch.empty(n, device='cuda') for n in (128, 1 << 21, 10 << 20)]\n    for t in ys: t.fill_(1)\np('captured')\ndel g, mp; gc.collect(); torch.cuda.empty_cache(); p('destroyed')\ndel ys; p('freed')\n" + END,
}
out = {}
for name, code in V.items():
    for conf in ("expandable_segments:True", ""):
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("frame #")][-3:]
        out[f"{name} [{conf or 'default'}]"] = {"rc": r.returncode, "out": r.stdout.split("\n")[-6:], "err": err}
        print(name, conf or "default", r.returncode, r.stdout.split(), err[-1:] if r.returncode else "", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"), indent=1)
