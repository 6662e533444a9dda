"""Render a GPU check's results folder (scripts/gpu_check.sh) as markdown: conformance cuda vs sim side by
side, benchmark figures against their targets, and the examples' lifecycle runs.

    python scripts/render_gpu_results.py docs/gpu-results/latest [earlier ...] > docs/gpu-results/RESULTS.md

An earlier folder is rendered after the latest, for the steps the latest did not run: each result file
appears once, from the newest folder that has it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys

from cudagraph_lifecycle.conformance import run_table

SHADOWED: set[str] = set()  # result files a newer folder already rendered


def load(folder: str, name: str):
    path = os.path.join(folder, name)
    return json.load(open(path)) if os.path.exists(path) and name not in SHADOWED else None


def gpu_name(summary: str) -> str:
    """The card's short name from the summary's GPU line ("NVIDIA H100 80GB HBM3, driver ..." -> "H100")."""
    m = re.search(r"^- GPU: (?:NVIDIA )?([^,\s]+)", summary, re.M)
    return m.group(1) if m else "GPU"


def main(folders: list[str]) -> None:
    names = [os.path.basename(os.path.normpath(f)) for f in folders]
    print("# GPU results\n")
    print(f"Every figure about GPU behaviour in these docs comes from this page: the latest run of "
          f"`scripts/gpu_check.sh` (through the device tool; the summary lists its calls), its summary and JSON files in "
          f"`docs/gpu-results/{names[0]}/`"
          + (f"; for the steps it did not run, the latest run that did ({', '.join(f'`{n}/`' for n in names[1:])}, "
             f"shown after it)" if names[1:] else "")
          + ". Earlier runs are in the git history of that folder. Rendered with "
          f"`python scripts/render_gpu_results.py {' '.join(names)}`.\n")
    for i, folder in enumerate(folders):
        if i == 0:
            render(folder, "## The run")
        else:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                render(folder, f"## {names[i]}: the steps {names[0]} did not run")
            # one heading level down, under the later run's page
            print("\n" + re.sub(r"^## (?!" + re.escape(names[i]) + ")", "### ", out.getvalue(), flags=re.M), end="")
        SHADOWED.update(n for n in os.listdir(folder) if n.endswith(".json"))


def render(folder: str, title: str) -> None:
    summary = open(os.path.join(folder, "summary.md")).read().strip()
    print(summary.replace("# GPU check", title, 1))
    conf = load(folder, "conformance-cuda.json")
    if conf:
        sim = {r["scenario"]: r["outcome"] for r in run_table("sim")}
        rows = conf["rows"]
        same = sum(sim[r["scenario"]] == r["outcome"] for r in rows)
        print(f"\n## Conformance: cuda vs sim ({same}/{len(rows)} identical; "
              f"{sum(r['match'] for r in rows)}/{len(rows)} cuda outcomes as expected)\n")
        print(f"| scenario | cuda ({gpu_name(summary)}) | sim (CPU) | same |\n|---|---|---|---|")
        for r in rows:
            s = sim[r["scenario"]]
            print(f"| {r['scenario']} | {r['outcome']} | {s} | {'yes' if s == r['outcome'] else '**NO**'} |")
    br = load(folder, "bench-runner.json")
    benches = ("bench-runner.json", "bench-wrapper-cost.json", "bench-worker.json", "bench-mpi.json", "bench-soak.json",
               "bench-sanitizer-memory.json", "bench-plugin-import.json", "probe-capture-path.json",
               "bench-checked-llm.json")
    if any(load(folder, name) for name in benches):
        print("\n## Benchmarks (one run, side by side)\n")
        print("| figure | measured | target |\n|---|---|---|")
    if br:
        st, mem, rel, san = br.get("step"), br.get("memory") or {}, br.get("release"), br.get("sanitizer")
        if st:
            print(f"| runner step / raw copy-in + replay (launch-bound, batch 1, fp16) | {st['runner_over_raw']:.3f} "
                  f"({st['runner_us']:.1f} vs {st['raw_copy_replay_us']:.1f} µs; eager {st['eager_us']:.1f} µs) | ≤ 1.05 |")
        # older runs had one model; a run with --only leaves the memory part out
        cases = (mem.items() if "small" in mem else [("small", mem)]) if mem else []
        for name, m in cases:
            model = (f"{name}: hidden {m.get('hidden')}" + (f", ffn {m['ffn']}" if m.get("ffn") else "")
                     + f", {m.get('dtype', 'float32')}, sizes {m.get('sizes', '1..128')}")
            # no packing goes below the floor: where the floor itself is over 1.10 of the largest graph alone,
            # the floor row below is the target that can be met
            target = "≤ 1.10" + (f" (the floor alone is {m['packing_floor_mib'] / m['largest_alone_mib']:.2f}: "
                                 f"the next row's target holds)" if "packing_floor_mib" in m else "")
            print(f"| 8 sizes in one pool / largest alone ({model}) | {m['shared_over_largest']:.3f} "
                  f"({m['shared_largest_first_mib']:.0f} vs {m['largest_alone_mib']:.0f} MiB) | {target} |")
            if "packing_floor_mib" in m:
                print(f"| {name}: shared pool / packing floor (most large + most small bytes of one graph alone) | "
                      f"{m['shared_over_floor']:.3f} ({m['shared_largest_first_mib']:.0f} vs "
                      f"{m['packing_floor_mib']:.0f} MiB) | 1.00 |")
            print(f"| {name}: smallest-first / separate pools (MiB) | {m['shared_smallest_first_mib']:.0f} / "
                  f"{m['separate_pools_mib']:.0f} | more than largest-first |")
            if "shared_one_output_buffer_mib" in m:
                print(f"| {name}: largest-first, every output copied into one buffer (MiB) | "
                      f"{m['shared_one_output_buffer_mib']:.0f} | |")
            print(f"| {name}: reserved growth, one stream / a new stream per capture (MiB) | "
                  f"{m['one_stream_reserved_growth_mib']:.0f} / {m['new_stream_each_reserved_growth_mib']:.0f} | |")
        if rel:
            print(f"| bytes left after release: runner / naive keeping one output | {rel['runner_bytes_after_release']} / "
                  f"{rel['naive_bytes_after_release']} | 0 |")
        if san:
            how = f"{san['capture_ms_sanitized']:.2f} vs {san['capture_ms']:.2f} ms for 8 graphs"
            if "capture_overhead_ci95" in san:
                lo, hi = san["capture_overhead_ci95"]
                how = (f"median of {san['rounds']} paired rounds, 95% interval {lo * 100:+.1f} … {hi * 100:+.1f}%; "
                       + how)
            print(f"| sanitizer: capture time overhead | {san['capture_overhead'] * 100:+.1f}% ({how}) | ≤ 2% |")
            if "wrapper_us_per_capture" in san:
                by = san.get("wrapper_us_by_call")
                print(f"| sanitizer: its wrappers' own time per capture | {san['wrapper_us_per_capture']:.1f} µs "
                      f"({san['wrapper_share_of_capture'] * 100:.1f}% of capture time"
                      + (f"; by call, per call: {', '.join(f'{k} {v:.1f}' for k, v in by.items())} µs" if by else "")
                      + ") | |")
            print(f"| sanitizer: replay step ratio | {san['step_ratio']:.3f} | within noise |")
        for fl in br.get("flush", []):
            body = fl.get("body", "one op")
            path = f", capture path {fl['capture_path']}" if "capture_path" in fl else ""
            ci = fl.get("overhead_ci95")  # (absent from older results)
            ci = f"{fl['rounds']} rounds, 95% interval {ci[0] * 100:+.1f} … {ci[1] * 100:+.1f}%; " if ci else ""
            once = "overhead_per_round" in fl  # (older results: a sanitizer started for each round)
            us = f"{fl['us_per_capture']:.1f} µs a capture; " if "us_per_capture" in fl else ""
            print(f"| sanitizer{' started once' if once else ''}: `torch.cuda.graph` captures of {body} (a cache "
                  f"flush each) with {fl['pinned_pools']} released pools pinned{path} | {fl['overhead'] * 100:+.1f}% "
                  f"({us}{fl['capture_ms_sanitized']:.2f} vs {fl['capture_ms']:.2f} ms for {fl['graphs']} graphs; {ci}"
                  f"IQR {fl['overhead_iqr'][0] * 100:+.1f} … {fl['overhead_iqr'][1] * 100:+.1f}%) | "
                  f"{'≤ 5%' if body == 'one op' else ''} |")
            if once:
                lo, hi = fl["overhead_per_round_iqr"]
                print(f"| the same, {fl['pinned_pools']} pinned, a sanitizer started for each round of {fl['graphs']} "
                      f"(same rounds) | {fl['overhead_per_round'] * 100:+.1f}% (IQR {lo * 100:+.1f} … {hi * 100:+.1f}%) | |")
            if "overhead_python_path" in fl:
                lo, hi = fl["overhead_python_path_iqr"]
                print(f"| the same, {fl['pinned_pools']} pinned, the capture path in Python"
                      f"{', started for each round' if once else ''} (same rounds) | "
                      f"{fl['overhead_python_path'] * 100:+.1f}% (IQR {lo * 100:+.1f} … {hi * 100:+.1f}%) | |")
            if "overhead_of_bare_wrappers" in fl:
                lo, hi = fl["overhead_of_bare_wrappers_iqr"]
                print(f"| the same, {fl['pinned_pools']} pinned, with the four calls only wrapped by functions that call "
                      f"through | {fl['overhead_of_bare_wrappers'] * 100:+.1f}% (IQR {lo * 100:+.1f} … {hi * 100:+.1f}%) | |")
        chk = br.get("checks")
        if chk:
            print(f"| checked mode: step / default step (batch 3 on the batch-4 graph) | {chk['step_ratio']:.2f} "
                  f"({chk['step_us_checked']:.1f} vs {chk['step_us_default']:.1f} µs) | may cost more |")
            rounds = f", median of {chk['rounds']} rounds" if "rounds" in chk else ""
            print(f"| checked mode: capture / default capture (4 graphs{rounds}) | {chk['capture_ratio']:.2f} "
                  f"({chk['capture_ms_checked']:.1f} vs {chk['capture_ms_default']:.1f} ms) | may cost more |")
            for name in ("capture", "capture_largest", "padding", "outputs"):
                if f"step_ratio_{name}" in chk:
                    label = "`capture` alone, `watch=\"largest\"`" if name == "capture_largest" else f"`{name}` alone"
                    rng = chk.get(f"capture_ratio_{name}_range")  # (absent from older results)
                    spread = f"; rounds {rng[0]:.2f} … {rng[1]:.2f}" if rng else ""
                    print(f"| check {label}: step; capture (/ default) | {chk[f'step_ratio_{name}']:.2f} "
                          f"({chk[f'step_us_{name}']:.1f} µs); {chk[f'capture_ratio_{name}']:.2f} "
                          f"({chk[f'capture_ms_{name}']:.1f} ms{spread}) | |")
            if "check_addresses_us" in chk:
                print(f"| `check_addresses()` (4 graphs of 16 layers) | {chk['check_addresses_us']:.0f} µs a call | |")
    wc = load(folder, "bench-wrapper-cost.json")
    if wc:
        for flow in ("runner", "runner_through_wrappers", "graph_0_pinned", "graph_8_pinned"):
            if flow not in wc:
                continue
            calls = {k: v for k, v in wc[flow].items() if isinstance(v, dict)}
            print(f"| wrapper cost, {flow.replace('_', ' ')}: µs a capture; median per call | "
                  f"{wc[flow]['wrapper_us_per_capture']:.1f}; "
                  + ", ".join(f"{k} {v['wrapper_us_median']:.1f} ({v['calls']} calls)" for k, v in calls.items())
                  + " | |")
            split = {k: v for k, v in calls.items() if "wrapper_us_first_of_round_median" in v}
            if split:
                print(f"| wrapper cost, {flow.replace('_', ' ')}: a round's first call / the others (median µs); "
                      "µs a round | " + ", ".join(
                          f"{k} {v['wrapper_us_first_of_round_median']:.1f} / {v['wrapper_us_rest_median']:.1f}; "
                          f"{v['wrapper_us_per_round']:.0f}" for k, v in split.items()) + " | |")
        seg = wc.get("graph_segments")
        if seg:
            for side, row in seg.items():
                if not isinstance(row, dict) or "overhead" not in row:
                    continue
                print(f"| `torch.cuda.graph` flow, {side.replace('_', ' ')} ({seg['rounds']} rounds): overhead; µs a "
                      f"capture added entering / in the op / leaving | {row['overhead'] * 100:+.1f}% (IQR "
                      f"{row['overhead_iqr'][0] * 100:+.1f} … {row['overhead_iqr'][1] * 100:+.1f}%); "
                      f"{row['extra_enter_us']:+.1f} / {row['extra_op_us']:+.1f} / {row['extra_exit_us']:+.1f} | |")
        lay = wc.get("runner_capture_begin_layers")
        if lay:
            print("| the floor under `capture_begin` in the runner's flow, median µs: "
                  + "; ".join(f"{k.replace('_', ' ')} {v['us_median']:.1f}" for k, v in lay.items()) + " | | |")
    bw = load(folder, "bench-worker.json")
    if bw:
        print(f"| worker call / bare Pipe round trip | {bw['call']['ratio']:.2f} ({bw['call']['worker_call_us']:.0f} "
              f"vs {bw['call']['bare_pipe_roundtrip_us']:.0f} µs) | ≤ 1.5 |")
        print(f"| forked worker ready / bare fork + first result | {bw['start']['ratio']:.2f} "
              f"({bw['start']['worker_ready_ms']:.1f} vs {bw['start']['bare_fork_first_result_ms']:.1f} ms) | ≤ 1.5 |")
        pe = bw["per_engine"]
        print(f"| per engine: fresh process / reused worker | {pe['ratio']:.0f}× ({pe['fresh_process_s']:.2f} vs "
              f"{pe['reused_worker_s']:.3f} s) | ≥ 200× |")
    bm = load(folder, "bench-mpi.json")
    if bm:
        pe = bm["per_engine"]
        print(f"| per engine: fresh mpirun / reused rank (2 ranks) | {pe['ratio']:.0f}× ({pe['fresh_mpirun_s']:.2f} vs "
              f"{pe['reused_rank_s']:.3f} s) | |")
    soak = load(folder, "bench-soak.json")
    if soak:
        sm = soak["summary"]
        against = ""
        if "ratio_first20_median" in sm:  # the cycle against a reference timed beside it
            against = (f"; cycle / reference {sm['ratio_first20_median']:.2f} → {sm['ratio_last20_median']:.2f} "
                       f"(first 20 spread {sm['ratio_first20_spread'][0]:.2f}–{sm['ratio_first20_spread'][1]:.2f}; "
                       f"reference {sm['reference_ms_first20_median']:.1f} → {sm['reference_ms_last20_median']:.1f} ms)")
        print(f"| soak: {sm['engines']} engines in one reused worker | verdicts {sm['verdicts']}, most bytes left in a "
              f"graph pool {sm['max_pool_bytes_after_release']}, cycle {sm['cycle_ms_first20_median']:.0f} → "
              f"{sm['cycle_ms_last20_median']:.0f} ms (first 20 spread {sm['cycle_ms_first20_spread'][0]:.0f}–"
              f"{sm['cycle_ms_first20_spread'][1]:.0f}){against}; "
              f"{'pass' if sm['pass'] else '**FAIL**'} | 0 bytes, no trend |")
    sm = load(folder, "bench-sanitizer-memory.json")
    if sm:
        last = sm["rounds"][-1]
        if "growth_last_round_ours" in sm:  # every Python object counted, with the plain rounds beside them
            print(f"| sanitizer memory ({last['captures']} captures a round, {len(sm['rounds'])} rounds, capture path "
                  f"{sm['meta'].get('capture_path', '?')}): Python bytes per live graph (over plain rounds); per "
                  f"erased pool's record (at most {sm['erased_records_bound']}); growth over the last round, in this "
                  f"package's files / in all | {sm['bytes_per_live_graph']:.0f} B; "
                  f"{sm['bytes_per_erased_pool_record']:.0f} B; {sm['growth_last_round_ours']:+d} B / "
                  f"{sm['growth_last_round']:+d} B | no growth |")
        else:  # (runs up to 16: counted in this package's files only, which misses what C code allocates)
            print(f"| sanitizer memory ({last['captures']} captures a round, {len(sm['rounds'])} rounds): Python bytes "
                  f"per live graph; per erased pool's record (at most {sm['erased_records_bound']}); growth over the "
                  f"last round | {sm['bytes_per_live_graph']:.0f} B; {sm['bytes_per_erased_pool_record']:.0f} B; "
                  f"{sm['growth_last_round']:+d} B ({last['bytes_after_destroyed']} B held after each round) | no growth |")
    llm = load(folder, "bench-checked-llm.json")
    if llm:
        print(f"| checked mode on an LLM decode step ({llm['model']}; batch {llm['batch']} on the batch-"
              f"{llm['graph_batch']} graph, int64 token ids): step; capture set (/ unchecked, median of "
              f"{llm['rounds']} rounds) | {llm['step_ratio_checked']:.2f} ({llm['step_us_checked']:.0f} vs "
              f"{llm['step_us_unchecked']:.0f} µs); {llm['capture_ratio_checked']:.2f} ({llm['capture_ms_checked']:.1f} "
              f"vs {llm['capture_ms_unchecked']:.1f} ms); outputs differ by {llm['max_abs_diff_checked_vs_unchecked']:g} "
              "| may cost more; output unchanged |")
    pi = load(folder, "bench-plugin-import.json")
    if pi:
        print(f"| plugin auto-loaded / -p no:cudagraph, one-test session CPU time | {pi['cpu_ratio']:.2f} "
              f"({pi['cpu_s_loaded']:.2f} vs {pi['cpu_s_disabled']:.2f} s) | ≤ 1.15 |")
    probe = load(folder, "probe-capture-path.json")
    if probe:
        names = {"weak_reference_alone": "a weak reference alone (no sanitizer)", "sanitizer": "the sanitizer",
                 "lean": "the sanitizer, lean variant", "py_minimal": "the common path's work alone, Python",
                 "compiled": "the same work, compiled (C)"}
        for side, words in names.items():
            row = probe.get(side)
            if row:
                print(f"| probe, `torch.cuda.graph` one op ({probe['rounds']} rounds): {words}: overhead; µs added "
                      f"entering / in the op / leaving | {row['overhead']:+.1%}; {row['extra_enter_us']:+.1f} / "
                      f"{row['extra_op_us']:+.1f} / {row['extra_exit_us']:+.1f} | |")
        if not probe.get("compiled_built"):
            print("| probe: the compiled side | not built (no C compiler on the machine) | |")
    print_before_after(folder)
    matrix = load(folder, "peer-matrix.json")
    if matrix:
        print_matrix(matrix)
    cmp = load(folder, "pytorch-graph-tests-compare.json")
    if cmp:
        print(f"\n## PyTorch's own CUDA graph tests, plain and under CUDAGRAPH_SANITIZE=1\n\nplain {cmp['plain']}; "
              f"under the sanitizer {cmp['with_tool']}; **{len(cmp['differ'])} test(s) with another outcome**\n")
        for d in cmp["differ"]:
            print(f"- `{d['test']}`: {d['plain']} plain, {d['with_tool']} under the sanitizer ({d['message']})")
        failed = sorted(t for t, o in cmp["tests"].items() if o["plain"] in ("failed", "error"))
        if failed:
            print(f"- failing plain as well, so not the sanitizer's (written for a newer torch than the machine's): "
                  + ", ".join(f"`{t.split('::')[-1]}`" for t in failed))
    pt = load(folder, "pytorch-graph-tests.json")
    if pt:
        outcomes = {}
        for test in pt["tests"]:
            outcomes[test["outcome"]] = outcomes.get(test["outcome"], 0) + 1
        found = pt.get("sanitizer", []) + [f for t in pt["tests"] for f in t.get("sanitizer") or []]
        print(f"\n## PyTorch's own CUDA graph tests under CUDAGRAPH_SANITIZE=1\n\ntests {outcomes}; "
              f"{len(found)} finding(s)\n")
        for f in found:
            pins = "; ".join(f"{p['cause']} {p['bytes']} B: {p['holder']}" for p in f.get("pins", []))
            print(f"- {f['kind']} pool {tuple(f['pool_id'] or ())}, {f['bytes']} B, test {(f.get('tests') or ['-'])[0]}, "
                  f"captured at {(f.get('sites') or ['-'])[0]}" + (f"; pinned by {pins}" if pins else ""))
    for name in ("examples-fork.json", "examples-spawn.json", "examples-mpi.json"):
        ex = load(folder, name)
        if ex:
            t = ex["totals"]
            outcomes = {}
            for test in ex["tests"]:
                outcomes[test["outcome"]] = outcomes.get(test["outcome"], 0) + 1
            verdicts = ", ".join(f"{v} {t[v]}" for v in ("fresh", "held", "leaked", "stale", "reused", "error")
                                 if t.get(v))
            print(f"\n{name}: start method {ex['meta']['start_method']}, backend {ex['meta']['effective_backend']}, "
                  f"exit {ex['meta']['exitstatus']}; tests {outcomes}; cycles {t['cycles']} ({verdicts}); "
                  f"lifecycle failures {t.get('lifecycle_failures')}")


def print_matrix(report: dict) -> None:
    """The peer-style engine matrix: per style and caller, whether the three sanitizer modes gave every engine
    the same verdict, bytes and pins (the verdicts shown are strict's, the last run of the cell), and whether
    plain PyTorch's asserts fell where the table says stale."""
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for test in report["tests"]:
        m = re.search(r"\[(\w)-(hold|drop)(?:-(on|off))?\]", test["nodeid"])
        if not m:
            continue
        cell = cells.setdefault(m.groups()[:2], {})
        passed = test["outcome"] == "passed"
        if "test_verdicts" in test["nodeid"]:  # (runs before the three-mode test: one test per mode)
            cell["modes"] = "; ".join(filter(None, [cell.get("modes"), f"{m.group(3)}: " + " ".join(
                c["verdict"] for c in test["cycles"]) + ("" if passed else f" ({test['outcome'].upper()})")]))
        elif "whatever_watches" in test["nodeid"]:
            cell["modes"] = ("off = on = strict: " + " ".join(c["verdict"] for c in test["cycles"]) + ("" if passed else
                             f" ({test['outcome'].upper()})")) if test["outcome"] != "skipped" else "skipped"
        else:
            cell["truth"] = "as the table" if passed else test["outcome"].upper()
    ok = sum(1 for t in report["tests"] if t["outcome"] == "passed")
    print(f"\n## Peer-style engine matrix ({ok}/{len(report['tests'])} tests passed)\n")
    print("| style | caller | the plugin's verdicts by sanitizer mode | plain PyTorch |\n|---|---|---|---|")
    for (style, mode), cell in sorted(cells.items()):
        print(f"| {style} | {mode} | {cell.get('modes', '-')} | {cell.get('truth', '-')} |")


def print_before_after(folder: str) -> None:
    """The runner and worker benches on a baseline tree and on this one, in the same call (GPU_CHECK_BASELINE)."""
    pairs = [("bench-runner-baseline.json", "bench-runner.json"), ("bench-worker-baseline.json", "bench-worker.json")]
    before, after = ({k: v for p in pairs for k, v in (load(folder, p[i]) or {}).items()} for i in (0, 1))
    if not before:
        return
    rows = []
    if "step" in before and "step" in after:
        rows.append(("runner step / raw copy-in + replay", before["step"]["runner_over_raw"],
                     after["step"]["runner_over_raw"], "{:.3f}"))
    if "sanitizer" in before and "sanitizer" in after:
        rows.append(("runner capture set under the sanitizer: overhead", before["sanitizer"]["capture_overhead"],
                     after["sanitizer"]["capture_overhead"], "{:+.1%}"))
    for i, label in ((0, "one-op capture, 0 pools pinned"), (1, "one-op capture, 8 pools pinned")):
        fb, fa = ((x.get("flush") or [])[i] if len(x.get("flush") or []) > i else None for x in (before, after))
        if fb and fa:
            rows.append((f"{label}: sanitizer overhead, compiled path", fb["overhead"], fa["overhead"], "{:+.1%}"))
            rows.append((f"{label}: sanitizer overhead, Python path", fb["overhead_python_path"],
                         fa["overhead_python_path"], "{:+.1%}"))
    if "call" in before and "call" in after:
        rows.append(("worker call / bare Pipe round trip", before["call"]["ratio"], after["call"]["ratio"], "{:.2f}"))
    if "per_engine" in before and "per_engine" in after:
        rows.append(("per engine: fresh process / reused worker", before["per_engine"]["ratio"],
                     after["per_engine"]["ratio"], "{:.0f}×"))
    print("\n## Before and after (the baseline tree and this one, benched in the same call)\n")
    print("| figure | baseline | this tree |\n|---|---|---|")
    for label, b, a, fmt in rows:
        print(f"| {label} | {fmt.format(b)} | {fmt.format(a)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
