#!/usr/bin/env bash
# The whole GPU check in one call (device tool), in two phases: first the correctness steps at once
# (conformance on cuda, GPU tests, the peer-style engine matrix, the piecewise engines, the examples'
# lifecycle suite on both worker paths (fork and spawn), with -n 2 and on MPI ranks; the plugin-import bench
# and the capture paths' equality on sim beside them), then the soak and the benchmarks one at a time (runner, with the
# sanitizer's capture path compiled and in Python side by side; worker; wrapper cost; sanitizer memory; MPI;
# the timed probes).
#   run: bash scripts/gpu_check.sh      (writes to $OUT, or ./gpu-out when OUT is unset; carry .whl/, which holds
#        jsonschema's wheels for Python 3.12: pip download jsonschema --only-binary=:all: --python-version 3.12
#        --platform manylinux2014_x86_64 -d .whl)
# Every step runs under one deadline (GPU_CHECK_SECONDS, default 570) so the results archive is always
# written inside the device tool's 10-minute limit; a step that no time is left for is listed as skipped.
# GPU_CHECK_ONLY (an extended regex) runs only the steps whose names match, for a session short of device
# time; the others are listed as not selected. GPU_CHECK_BASELINE (a folder holding another tree's src/,
# pytest_cudagraph/, bench/, examples/ (its worker bench imports the engines there), setup.py and
# pyproject.toml: `git archive <commit> src pytest_cudagraph bench examples setup.py pyproject.toml README.md`
# of the tree before a refactor, carried) runs the runner (its step, sanitizer and flush parts) and worker
# benchmarks on that tree too, in the same call, beside this tree's: a before/after on one machine. GPU_CHECK_COMMIT names this tree's commit in the summary (the machine gets no .git).
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
R=$(mktemp -d)/gpu-results    # everything lands here, then travels back as one archive
mkdir -p "$R"
LOG=$R/full.log
exec > >(tee "$LOG") 2>&1
export PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-570}))
rc=0
# step NAME CMD...: run CMD under what is left of the deadline; its outcome and time go into summary.md
step() {
  local name=$1; shift
  local left=$((DEADLINE - SECONDS)) t0=$SECONDS r
  if [ -n "${GPU_CHECK_ONLY:-}" ] && ! [[ $name =~ $GPU_CHECK_ONLY ]]; then
    echo "- ${name}: not selected (GPU_CHECK_ONLY)" >> "$R/steps.md"; return
  fi
  echo; echo "=== $name ($(date -u +%H:%M:%S), ${left}s left)"
  if [ "$left" -lt 15 ]; then
    echo "- ${name}: SKIPPED (no time left)" >> "$R/steps.md"; rc=1; return
  fi
  timeout "$left" "$@"; r=$?
  echo "- ${name}: $([ $r = 0 ] && echo ok || echo "FAILED (rc $r)") in $((SECONDS - t0)) s" >> "$R/steps.md"
  [ $r = 0 ] || rc=1
}
# beside NAME CMD...: a step run in the background, at the same time as the steps around it; `join` waits for
# all of them and adds each one's outcome and output, in the order they began. The correctness steps can
# share the machine: no figure of theirs is a time, and each judges only its own processes' pools, which
# other processes on the GPU do not change. One after another, the steps took about 700 s on an H100 in run
# 32, more than one call of the device tool allows; in the two phases, 423 s in run 33.
BESIDE=() BESIDE_PIDS=()
beside() {
  local name=$1; shift
  if [ -n "${GPU_CHECK_ONLY:-}" ] && ! [[ $name =~ $GPU_CHECK_ONLY ]]; then
    echo "- ${name}: not selected (GPU_CHECK_ONLY)" >> "$R/steps.md"; return
  fi
  local n=${#BESIDE[@]} left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then  # (timeout 0 would mean no limit, and the wait at the end would outlive the call)
    echo "- ${name}: SKIPPED (no time left)" >> "$R/steps.md"; rc=1; return
  fi
  echo "=== $name (in the background from $(date -u +%H:%M:%S), ${left}s left)"
  ( t0=$SECONDS; timeout "$left" "$@" > "$R/beside-$n.log" 2>&1; echo "$? $((SECONDS - t0))" > "$R/beside-$n.rc" ) &
  BESIDE+=("$name") BESIDE_PIDS+=($!)
}
JOINED=0
join() {
  local n r t
  [ ${#BESIDE_PIDS[@]} = "$JOINED" ] || wait "${BESIDE_PIDS[@]:$JOINED}"  # (a bare wait would also wait for the log's tee)
  for ((n = JOINED; n < ${#BESIDE[@]}; n++)); do
    echo; echo "=== ${BESIDE[$n]} (in the background)"; cat "$R/beside-$n.log"
    read -r r t 2>/dev/null < "$R/beside-$n.rc" || { r=1; t=?; }
    echo "- ${BESIDE[$n]}: $([ "$r" = 0 ] && echo ok || echo "FAILED (rc $r)") in $t s" >> "$R/steps.md"
    [ "$r" = 0 ] || rc=1
    rm -f "$R/beside-$n.log" "$R/beside-$n.rc"
  done
  JOINED=${#BESIDE[@]}
}

echo "=== install"
rm -rf /tmp/site  # a warm machine keeps an earlier call's install: measure this tree, not that one
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . 2>&1 | tail -3 \
  || python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/pytest_cudagraph-*.whl
export PYTHONPATH=/tmp/site
# jsonschema is not in the machine's image: its wheels travel in .whl/ (carry it), for the reports' schema check
python3 -c "import jsonschema" 2>/dev/null || python3 -m pip install -q --no-deps --no-index --target /tmp/site \
  .whl/jsonschema-*.whl .whl/jsonschema_specifications-*.whl .whl/referencing-*.whl .whl/rpds_py-*.whl 2>&1 | tail -2
python3 - <<'PY' | tee "$R/summary.md"
import datetime, subprocess, torch
print("# GPU check")
print(f"- date: {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC")
print(f"- torch: {torch.__version__}, CUDA {torch.version.cuda}")
print(f"- GPU: {torch.cuda.get_device_name(0)}, driver "
      + subprocess.run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'],
                       capture_output=True, text=True).stdout.strip())
import pytest, importlib.metadata as md
print(f"- pytest {pytest.__version__}, pytest-cudagraph {md.version('pytest-cudagraph')}")
try:
    import transformers
    print(f"- transformers {transformers.__version__} (the real-model engines)")
except ImportError as e:
    print(f"- transformers: not importable ({e}): the real-model engines skip")
from cudagraph_lifecycle.observe import compiled
print(f"- capture path: {compiled.describe()}")
import hashlib, os, pathlib
files = sorted(p for d in ("src", "pytest_cudagraph") for p in pathlib.Path(d).rglob("*") if p.suffix in (".py", ".c", ".json"))
digest = hashlib.sha256(b"".join(p.as_posix().encode() + p.read_bytes() for p in files)).hexdigest()[:12]
print(f"- commit: {os.environ.get('GPU_CHECK_COMMIT', '(not given)')}; sources sha256 {digest} ({len(files)} files)")
print(f"- command: `GPU_CHECK_ONLY={os.environ.get('GPU_CHECK_ONLY', '')!r} GPU_CHECK_SECONDS={os.environ.get('GPU_CHECK_SECONDS', '570')} "
      f"GPU_CHECK_BASELINE={os.environ.get('GPU_CHECK_BASELINE', '')!r} bash scripts/gpu_check.sh`")
PY
PT="python3 -m pytest -p cudagraph -p no:cacheprovider --cudagraph-require-gpu"

# phase 1: correctness, all at once; the plugin-import bench beside it is a ratio of paired sessions, so
# the load reaches both sides
beside "bench plugin import (CUDA build of torch)" python3 bench/bench_plugin_import.py --rounds 20 \
  --json "$R/bench-plugin-import.json"
# the C capture path on this machine's Python (3.12 there, 3.11 in CI): both paths equal, no leak (on sim)
beside "capture paths equal (compiled vs Python, on sim)" python3 -m pytest -p cudagraph -p no:cacheprovider -q \
  tests/test_capture_paths.py tests/test_checks.py
beside "conformance on cuda" python3 -m cudagraph_lifecycle.conformance --backend cuda --jobs 8 \
  --json "$R/conformance-cuda.json"
beside "GPU tests" $PT -q -rP tests/test_gpu.py
if [ -f .ptests/test_pytorch_graphs.py ]; then
  # PyTorch's own TestCuda graph tests (extracted from pytorch/pytorch test/test_cuda.py, carried, not committed:
  # a checkout has no .ptests/; rebuild it from the tool library's copy of test/test_cuda.py at pytorch commit
  # 000e43cd, its TestCuda graph methods and the names they import, with the missing ones guarded for torch
  # 2.11), once plain (no plugin) and once under a session-wide sanitizer; the
  # comparison after the join judges them: a test written for a newer torch fails in both runs alike, and
  # only an outcome the sanitizer changed fails the check. (pytest's status 1, tests failed, is left to the
  # comparison; 2 and up, a collection or usage error, fails the step.) Stream.is_capturing is newer than 2.11.
  PTK="not test_graph_is_current_stream_capturing"
  beside "PyTorch's graph tests, plain (no plugin)" sh -c 'python3 -m pytest -p no:cudagraph -p no:cacheprovider \
    .ptests/test_pytorch_graphs.py -q -k "$1" --junitxml="$2"; [ $? -le 1 ]' - "$PTK" "$R/pytorch-graph-tests-plain.xml"
  beside "PyTorch's graph tests under CUDAGRAPH_SANITIZE=1" sh -c 'CUDAGRAPH_SANITIZE=1 $0 .ptests/test_pytorch_graphs.py \
    -q -k "$1" --junitxml="$2" --cudagraph-report="$3"; [ $? -le 1 ]' "$PT" "$PTK" "$R/pytorch-graph-tests-sanitized.xml" \
    "$R/pytorch-graph-tests.json"
fi
beside "peer-style engine matrix (16 styles x hold/drop x sanitizer off/on/strict; plain PyTorch's truth)" \
  $PT tests/test_peer_matrix.py -n 8 --cudagraph-report="$R/peer-matrix.json" -q
beside "real-model engines (a transformers Llama on token ids, static KV cache: 7 styles x hold/drop x off/on/strict; plain PyTorch's truth)" \
  $PT tests/test_real_model.py -n 4 --cudagraph-report="$R/real-model.json" -q
beside "piecewise engines (vLLM v1 style: pieces of every batch size in one pool)" \
  $PT tests/test_piecewise_engines.py --cudagraph-backend=cuda -n 4 -q --cudagraph-report="$R/piecewise.json"
beside "examples, fork path (pytest process without CUDA)" $PT examples/ --cudagraph-report="$R/examples-fork.json"
beside "examples, spawn path (pytest process initialized CUDA)" env CUDAGRAPH_EXAMPLES_INIT_CUDA=1 \
  $PT examples/ --cudagraph-report="$R/examples-spawn.json"
beside "examples, -n 2 on one GPU" $PT examples/ -n 2 -q
beside "examples on 2 MPI ranks sharing the GPU" $PT examples/test_mpi_lifecycle.py --cudagraph-require-mpi \
  --cudagraph-report="$R/examples-mpi.json"
join
if [ -f .ptests/test_pytorch_graphs.py ]; then
  step "PyTorch's graph tests: every outcome under the sanitizer as plain" python3 scripts/compare_outcomes.py \
    "$R/pytorch-graph-tests-plain.xml" "$R/pytorch-graph-tests-sanitized.xml" --json "$R/pytorch-graph-tests-compare.json"
  rm -f "$R"/pytorch-graph-tests-*.xml  # the comparison's JSON holds every test's two outcomes
fi
# phase 2: the benches and timed probes, one at a time
# (the soak's verdicts are bytes, but its no-trend check times each cycle against a reference: under the
# first phase's changing load it failed in run 33)
step "soak: 200 engines in one reused worker" python3 bench/bench_soak.py --backend cuda --engines 200 \
  --json "$R/bench-soak.json"
# GPU_CHECK_RUNNER_ONLY: the runner bench's parts (e.g. "--only step --only sanitizer --only flush"), both trees
step "bench runner" python3 bench/bench_runner.py --backend cuda ${GPU_CHECK_RUNNER_ONLY:-} --json "$R/bench-runner.json"
step "bench worker" python3 bench/bench_worker.py --backend cuda --engines 3 --json "$R/bench-worker.json"
if [ -n "${GPU_CHECK_BASELINE:-}" ]; then
  # the same benches on the baseline tree, installed apart and run with that tree's own bench/ scripts
  rm -rf /tmp/site-base
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site-base "$GPU_CHECK_BASELINE" \
    2>&1 | tail -3
  step "bench runner, baseline tree" env PYTHONPATH=/tmp/site-base:$GPU_CHECK_BASELINE \
    python3 "$GPU_CHECK_BASELINE/bench/bench_runner.py" --backend cuda \
    ${GPU_CHECK_RUNNER_ONLY:---only step --only sanitizer --only flush} --json "$R/bench-runner-baseline.json"
  step "bench worker, baseline tree" env PYTHONPATH=/tmp/site-base:$GPU_CHECK_BASELINE \
    python3 "$GPU_CHECK_BASELINE/bench/bench_worker.py" --backend cuda --engines 3 --json "$R/bench-worker-baseline.json"
fi
step "bench checked mode on an LLM decode step (transformers Llama, int64 token ids)" python3 bench/bench_checked_llm.py \
  --backend cuda --json "$R/bench-checked-llm.json"
step "bench wrapper cost (each observed call, timed from outside)" python3 bench/bench_wrapper_cost.py --backend cuda \
  --rounds 25 --segment-rounds 60 --json "$R/bench-wrapper-cost.json"
step "bench sanitizer memory (10,000 captures a round)" python3 bench/bench_sanitizer_memory.py --backend cuda \
  --json "$R/bench-sanitizer-memory.json"
step "bench mpi" python3 bench/bench_mpi.py --backend cuda --ranks 2 --engines 3 --json "$R/bench-mpi.json"
step "probe: checked mode's watch, a dispatch mode against a function mode" python3 scripts/probes/watch_modes.py \
  --json "$R/probe-watch-modes.json"
step "probe: the one-op figure, pools pinned, heap frozen or live, sanitizer per round or started once" \
  python3 scripts/probes/pinned_flush.py --json "$R/probe-pinned-flush.json"
# every JSON report of this run (written on cuda) against the schema the package ships
python3 - "$R" <<'PY' || rc=1
import glob, json, sys
import jsonschema
from pytest_cudagraph.records import schema
bad = 0
for path in sorted(glob.glob(sys.argv[1] + "/*.json")):
    data = json.load(open(path))
    if isinstance(data, dict) and "tests" in data and "totals" in data:  # a --cudagraph-report file
        try:
            jsonschema.validate(data, schema())
            print(f"schema: {path.rsplit('/', 1)[1]} valid")
        except jsonschema.ValidationError as e:
            bad += 1
            print(f"schema: {path.rsplit('/', 1)[1]} INVALID: {e.message} at {list(e.absolute_path)}")
with open(sys.argv[1] + "/steps.md", "a") as f:
    f.write(f"- reports against report.schema.json: {'ok' if not bad else f'FAILED ({bad} invalid)'}\n")
sys.exit(bool(bad))
PY
echo; echo "=== done rc=$rc"
sleep 1
{ echo; echo "## Steps"; cat "$R/steps.md"; } >> "$R/summary.md"
cp "$R/summary.md" "$OUT/" 2>/dev/null
tar -czf "$OUT/gpu-results.tgz" -C "$(dirname "$R")" gpu-results
exit $rc
