#!/usr/bin/env bash
# The whole GPU check in one call (device tool): conformance on cuda, GPU tests, the examples' lifecycle
# suite on both worker paths (fork and spawn) and with -n 2, and the benchmarks.
#   run: bash scripts/gpu_check.sh      (writes to $OUT, or ./gpu-out when OUT is unset)
set -u -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
R=$(mktemp -d)/gpu-results    # everything lands here, then travels back as one archive
mkdir -p "$R"
LOG=$R/full.log
exec > >(tee "$LOG") 2>&1
export PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; STEP="$*"; T0=$SECONDS; }
# the outcome of each step goes into summary.md, so the committed results say what passed
mark() { local r=$?; echo "- ${STEP}: $([ $r = 0 ] && echo ok || echo "FAILED (rc $r)") in $((SECONDS - T0)) s" >> "$R/steps.md"; [ $r = 0 ] || rc=1; }

step install
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . 2>&1 | tail -3 \
  || python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/pytest_cudagraph-*.whl
export PYTHONPATH=/tmp/site
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
PY
rc=0
step conformance on cuda
python3 -m cudagraph_lifecycle.conformance --backend cuda --jobs 8 --json "$R/conformance-cuda.json"; mark
step GPU tests
python3 -m pytest -p cudagraph -q -rP tests/test_gpu.py --cudagraph-require-gpu -p no:cacheprovider; mark
step "examples, fork path (pytest process without CUDA)"
python3 -m pytest -p cudagraph examples/ --cudagraph-require-gpu --cudagraph-report="$R/examples-fork.json" \
  -p no:cacheprovider; mark
step "examples, spawn path (pytest process initialized CUDA)"
CUDAGRAPH_EXAMPLES_INIT_CUDA=1 python3 -m pytest -p cudagraph examples/ --cudagraph-require-gpu \
  --cudagraph-report="$R/examples-spawn.json" -p no:cacheprovider; mark
step "examples, -n 2 on one GPU"
python3 -m pytest -p cudagraph examples/ -n 2 --cudagraph-require-gpu -p no:cacheprovider -q; mark
step bench runner
python3 bench/bench_runner.py --backend cuda --json "$R/bench-runner.json"; mark
step bench worker
python3 bench/bench_worker.py --backend cuda --engines 3 --json "$R/bench-worker.json"; mark
step "examples on 2 MPI ranks sharing the GPU"
python3 -m pytest -p cudagraph examples/test_mpi_lifecycle.py --cudagraph-require-gpu --cudagraph-require-mpi \
  --cudagraph-report="$R/examples-mpi.json" -p no:cacheprovider; mark
step bench mpi
python3 bench/bench_mpi.py --backend cuda --ranks 2 --engines 3 --json "$R/bench-mpi.json"; mark
step done rc=$rc
sleep 1
{ echo; echo "## Steps"; cat "$R/steps.md"; } >> "$R/summary.md"
cp "$R/summary.md" "$OUT/" 2>/dev/null
tar -czf "$OUT/gpu-results.tgz" -C "$(dirname "$R")" gpu-results
exit $rc
