"""What each way of reading a tensor on the host does to a capture, on a backend, each case in a fresh process:
the error at the read (if any), the error at ``capture_end``, whether eager random ops still work after, and
the pool's reference count after ``reset()``. ``.item()`` is the conformance table's case; the others
(``.tolist()``, ``.cpu()``, ``nonzero``, a boolean mask, a print) are what engines do by accident, and what
``sim`` must refuse as CUDA does.

    python scripts/probes/host_reads.py --backend cuda [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = ("item", "tolist", "cpu", "nonzero", "bool_mask", "print", "masked_select", "none")

CHILD = r'''
import json, sys, torch
from cudagraph_lifecycle.backends import isolated_backend
from cudagraph_lifecycle.conformance import Ctx
case, backend = sys.argv[1], sys.argv[2]
be = isolated_backend(backend)
c = Ctx(be)
x = c.tensor()
reads = {
    "item": lambda y: y.sum().item(),
    "tolist": lambda y: y.tolist(),
    "cpu": lambda y: y.cpu(),
    "nonzero": lambda y: y.nonzero(),
    "bool_mask": lambda y: y[y > 0],
    "print": lambda y: str(y),
    "masked_select": lambda y: torch.masked_select(y, y > 0),
    "none": lambda y: y + 1,
}
def line(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if e is not None else None
mp = be.mempool(0)
g = be.new_graph()
at_read = at_end = None
with be.stream(c.stream):
    g.capture_begin(pool=mp.id)
    try:
        reads[case](x * 2)
    except Exception as e:
        at_read = e
    try:
        g.capture_end()
    except Exception as e:
        at_end = e
g.reset()
try:
    be.randn(4)
    after = "ok"
except Exception as e:
    after = line(e)
print(json.dumps({"case": case, "at_read": line(at_read), "at_end": line(at_end), "random_after": after,
                  "use_count_after_reset": mp.use_count()}))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda", choices=["cuda", "sim"])
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for case in CASES:
        p = subprocess.run([sys.executable, "-c", CHILD, case, a.backend], capture_output=True, text=True,
                           timeout=120)
        out = p.stdout.strip().splitlines()
        row = json.loads(out[-1]) if p.returncode == 0 and out else {
            "case": case, "crashed": p.returncode, "stderr": p.stderr.strip().splitlines()[-3:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"backend": a.backend, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
