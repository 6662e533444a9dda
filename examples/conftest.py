import os
import sys

# Workers started by spawn import the engines by module name: keep this folder importable.
sys.path.insert(0, os.path.dirname(__file__))

if os.environ.get("CUDAGRAPH_EXAMPLES_INIT_CUDA") == "1":
    # The GPU check's spawn path: a pytest process that initialized CUDA must not fork its workers.
    import torch

    torch.cuda.init()
