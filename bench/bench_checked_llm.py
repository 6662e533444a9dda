"""What checked mode costs an LLM decode step: a random-weight Hugging Face Llama (tests/hf_engines.py) decoding
one token for a batch of 3 sequences on token ids (int64) from a static KV cache, in a ``CUDAGraphRunner``
with and without the checks, side by side.

Per round, each configuration once (the order reversed every other round): a capture set (batch sizes 1, 2,
4), then ``iters`` steps of batch 3 on the batch-4 graph (the padding check proves the pair at its first replay
and every ``recheck_every``-th; each proof replays twice and restores the KV cache the extra replay wrote).
Ratios are medians over the rounds of checked against unchecked of the same round. Every checked step's output
is compared with the unchecked runner's: the checks must not change what the engine computes.

    python bench/bench_checked_llm.py --backend cuda --json out.json
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from common import emit  # noqa: E402

from cudagraph_lifecycle import CUDAGraphRunner  # noqa: E402
from cudagraph_lifecycle.backends import get_backend  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args()
    import hf_engines

    why = hf_engines.missing()
    if why:
        sys.exit(f"bench_checked_llm: {why}")
    be = get_backend(args.backend)
    be.prewarm(0)
    dec = hf_engines._Decoder(be)
    x = dec.example_input()
    bs = dec.graph_size_for(x.shape[0])
    configs = {"unchecked": False, "checked": True}
    step = {c: [] for c in configs}
    capture = {c: [] for c in configs}
    worst = 0.0
    for rnd in range(args.rounds):
        outs = {}
        for name, checked in list(configs.items())[:: 1 if rnd % 2 == 0 else -1]:
            r = CUDAGraphRunner(dec.decode, hf_engines.BATCH_SIZES, (1,), dtype=torch.long, backend=be,
                                checked=checked, name=f"llm-{name}")
            with torch.no_grad():
                for b in hf_engines.BATCH_SIZES:  # every warm-up and capture is a step: from the prompt's end
                    dec.rewind(b)
                r.capture()
                capture[name].append(r.stats.capture_ms)
                assert not r.stats.failures, r.stats.failures
                be.synchronize()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    dec.rewind(bs)
                    y = r.run(x)
                be.synchronize()
                step[name].append((time.perf_counter() - t0) / args.iters * 1e6)
                outs[name] = y.float().clone()
            r.release()
            del r, y
        worst = max(worst, float((outs["checked"] - outs["unchecked"]).abs().max()))
    med = statistics.median
    out = {"backend": be.name, "model": "LlamaForCausalLM (2 layers, hidden 64, vocab 256), static cache",
           "batch": x.shape[0], "graph_batch": bs, "iters": args.iters, "rounds": args.rounds,
           "max_abs_diff_checked_vs_unchecked": worst}
    for name in configs:
        out[f"step_us_{name}"], out[f"capture_ms_{name}"] = med(step[name]), med(capture[name])
    for what, series in (("step", step), ("capture", capture)):
        ratios = [a / b for a, b in zip(series["checked"], series["unchecked"])]
        out[f"{what}_ratio_checked"] = med(ratios)
        out[f"{what}_ratio_checked_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    emit(out, args.json)
    if worst > 1e-3:
        sys.exit(f"checked mode changed the decode step's output by {worst:.3g}")


if __name__ == "__main__":
    main()
