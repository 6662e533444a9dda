"""GPU discovery in the pytest process without initializing CUDA (a CUDA parent cannot fork workers),
and the one-GPU-per-xdist-worker rule."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys


def torch_has_gpu_build() -> bool:
    """Whether the installed torch was built for CUDA or ROCm, read from its version file without importing
    torch (which costs seconds): a CPU build sees no GPU, whatever the machine has."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        text = open(path).read()
    except OSError:
        return True  # cannot tell: ask torch itself
    found = re.findall(r"^(cuda|hip)\s*(?::[^=]*)?=\s*(.+)$", text, re.M)
    return any(value.strip() not in ("None", "") for _, value in found) if found else True


def visible_gpu_count() -> int:
    """GPUs this process could use, read without creating a CUDA context."""
    if not torch_has_gpu_build():
        return 0
    import torch

    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    nvml = getattr(torch.cuda, "_device_count_nvml", None)
    n = nvml() if nvml is not None else -1
    if n >= 0:
        return n
    # No NVML: ask a throwaway process, so this one stays fork-safe.
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0)
    except (subprocess.TimeoutExpired, ValueError):
        return 0


def devices_for_worker(worker_index: int, n_workers: int, outer_visible: str | None, n_gpus: int) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` value for xdist worker ``worker_index`` of ``n_workers``.

    One GPU per worker, taken from the outer ``CUDA_VISIBLE_DEVICES`` list when one is set (indexed, not
    replaced). With more workers than GPUs, workers share GPUs round-robin (worker i gets GPU i mod n):
    every worker still has exactly one GPU. xdist names the worker that replaces a crashed one ``gw<k>``
    with k >= n_workers: it takes slot k mod n_workers (xdist does not say which worker it replaces).
    None when there is no GPU or a single worker.
    """
    if n_workers < 1 or worker_index < 0:
        raise ValueError(f"worker index {worker_index} of {n_workers} workers: expected n_workers >= 1 and "
                         "index >= 0")
    worker_index %= n_workers
    if outer_visible is not None and outer_visible.strip() != "":
        ids = [d.strip() for d in outer_visible.split(",") if d.strip()]
    else:
        ids = [str(i) for i in range(n_gpus)]
    if not ids or n_workers == 1:
        return None
    return ids[worker_index % len(ids)]


def pin_xdist_worker(workerid: str, n_workers: int) -> str | None:
    """Set ``CUDA_VISIBLE_DEVICES`` for this xdist worker before anything initializes CUDA."""
    index = int(workerid.lstrip("gw"))
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    n = visible_gpu_count() if outer is None else len([d for d in outer.split(",") if d.strip()])
    dev = devices_for_worker(index, n_workers, outer, n)
    if dev is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = dev
    return dev
