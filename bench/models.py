"""The models the benchmarks and probes capture."""

import torch


def launch_bound_model(dev, dtype):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256).to(dev, dtype) for _ in range(16)]

    def fwd(x):
        for lin in layers:
            x = torch.relu(lin(x))
        return x

    return fwd
