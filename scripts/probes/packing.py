"""Where a shared pool's bytes go: the segment map of the decode-sized model's graphs (bench_runner's memory
case), captured alone and 8 sizes into one pool in several orders, read from the allocator's snapshot.

    python scripts/probes/packing.py [--json PATH]      (CUDA only)

For each case: the pool's segments (size, small or large, the blocks live in it) and the peak bytes of small
(<= 1 MiB) blocks live at once during each capture, which decide how many 2 MiB small segments the pool needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

MiB = 1 << 20


def model(hidden=4096, ffn=14336, dtype=torch.bfloat16):
    torch.manual_seed(0)
    ws = [(torch.randn(hidden, ffn, device="cuda", dtype=dtype) * hidden**-0.5,
           torch.randn(ffn, hidden, device="cuda", dtype=dtype) * ffn**-0.5) for _ in range(4)]

    def fwd(x):
        for up, down in ws:
            x = x + torch.relu(x @ up) @ down
        return x

    return fwd, ws


def segments(pool):
    out = []
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", (0, 0))) != tuple(pool):
            continue
        live = [b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"]
        out.append({"mib": seg["total_size"] / MiB, "type": seg.get("segment_type"), "live_blocks": len(live),
                    "live_mib": sum(live) / MiB})
    return out


def case(fwd, sizes, order, one_output=False, hidden=4096, dtype=torch.bfloat16):
    static = torch.zeros(max(sizes), hidden, device="cuda", dtype=dtype)
    stream = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    keep, peaks = [], {}
    with torch.no_grad():
        for bs in order:
            with torch.cuda.stream(stream):
                fwd(static[:bs])
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                g.capture_begin(pool=pool)
                out = fwd(static[:bs])
                if one_output and keep:
                    out = keep[0][1][:bs].copy_(out)
                g.capture_end()
            keep.append((g, out))
            peaks[bs] = sum(s["mib"] for s in segments(pool))
    torch.cuda.synchronize()
    res = {"order": order, "one_output": one_output, "pool_mib_after_each": peaks, "segments": segments(pool)}
    res["pool_mib"] = sum(s["mib"] for s in res["segments"])
    res["small_segments"] = sum(1 for s in res["segments"] if s["type"] == "small")
    del keep, out, g
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return res


def runner_case(fwd, sizes, hidden=4096, dtype=torch.bfloat16):
    from cudagraph_lifecycle import CUDAGraphRunner

    r = CUDAGraphRunner(fwd, sizes, (hidden,), dtype=dtype, backend="cuda")
    r.capture()
    pool = r.pool_ids[0][1]
    res = {"segments": segments(pool), "graph_bytes": r.stats.graph_bytes}
    res["pool_mib"] = sum(s["mib"] for s in res["segments"])
    r.release()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    fwd, ws = model()
    sizes = [2, 4, 8, 16, 32, 64, 128, 256]
    desc = sorted(sizes, reverse=True)
    out = {"torch": torch.__version__,
           "largest_alone": case(fwd, sizes, [256]),
           "largest_first": case(fwd, sizes, desc),
           "smallest_first": case(fwd, sizes, sorted(sizes)),
           "largest_first_one_output": case(fwd, sizes, desc, one_output=True),
           "up_to_64_largest_first": case(fwd, [2, 4, 8, 16, 32, 64, 256], [256, 64, 32, 16, 8, 4, 2]),
           "alone_128": case(fwd, sizes, [128]),
           "runner": runner_case(fwd, sizes)}
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
