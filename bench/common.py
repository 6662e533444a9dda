"""Shared by the benchmarks: print the results and write them as JSON."""

import json


def emit(out: dict, path: str | None) -> None:
    print(json.dumps(out, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
