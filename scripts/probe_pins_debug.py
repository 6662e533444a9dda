"""Probe: why a leaked pool's pins come out empty or unknown on CUDA (peer style (c), drop; a training-style
make_graphed_callables). Prints the blocks, the autograd roots and what the walk saw.
  run on the GPU: python3 scripts/probe_pins_debug.py"""
import sys

sys.path.insert(0, "tests")
import gpu_cases  # noqa: E402
import peer_engines  # noqa: E402
import torch  # noqa: E402

from cudagraph_lifecycle.backends import get_backend  # noqa: E402
from cudagraph_lifecycle.cycle import run_cycle  # noqa: E402
from cudagraph_lifecycle.sanitizer import pins  # noqa: E402

orig = pins.what_pins


def traced(backend, keys, known=None):
    blocks = [(b.span, b.size) for k in keys for b in backend.live_blocks(k[2], k[1])]
    print("blocks", blocks[:8], flush=True)
    tensors = [o for o in __import__("gc").get_objects() if issubclass(type(o), torch.Tensor)]
    roots = [t for t in tensors if getattr(t, "grad_fn", None) is not None]
    print("tensors", len(tensors), "roots", len(roots), [(tuple(t.shape), t.device.type, type(t.grad_fn).__name__)
                                                          for t in roots[:6]], flush=True)
    for t in roots[:4]:
        todo, seen = [t.grad_fn], 0
        while todo and seen < 50:
            n = todo.pop()
            if n is None:
                continue
            seen += 1
            sv, unreadable = pins._saved(n)
            print("  node", type(n).__name__, "unreadable", unreadable, [backend.storage_span(x) for x in sv][:3],
                  flush=True)
            todo += [f for f, _ in n.next_functions]
    del tensors, roots, t
    out = orig(backend, keys, known)
    print("pins", out, flush=True)
    return out


pins.what_pins = traced
import cudagraph_lifecycle.cycle.steps as steps  # noqa: E402

steps.what_pins = traced
be = get_backend(sys.argv[1] if len(sys.argv) > 1 else "cuda")
CASES = [("c drop", peer_engines.STYLES["c"])] + ([("graphed bwd", gpu_cases.graphed_with_backward)] if be.name == "cuda" else [])
for name, factory in CASES:
    print("===", name, flush=True)
    recs = run_cycle(factory, be, 0, output="drop", test=name)
    for r in recs:
        print(r["verdict"], [(p["kind"], p["pins"]) for p in r["problems"]], flush=True)
