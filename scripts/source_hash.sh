#!/usr/bin/env bash
# The library's and the plugin's Python sources as one short hash: the GPU check prints it, and the same
# command on a checkout tells which tree ran (the device machine's copy of .git may name an older commit).
#   run: bash scripts/source_hash.sh   (from the repository root)
set -euo pipefail
find src/cudagraph_lifecycle pytest_cudagraph -name '*.py' -not -path '*/__pycache__/*' | LC_ALL=C sort \
  | xargs sha256sum | sha256sum | cut -c1-12
