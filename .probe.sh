set -x
nvidia-smi --query-gpu=name,driver_version --format=csv
python3 -c "import torch;print(torch.__version__, hasattr(torch._C,'_cuda_getPoolUseCount'))"
pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2 || true
export PYTHONPATH=$PWD/src:$PWD
python3 -m cudagraph_lifecycle.conformance --backend cuda --json $OUT/conf.json --jobs 8
