"""``python -m cudagraph_lifecycle.conformance --backend sim|cuda [--json PATH] [--jobs N]``."""

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main(prog="conformance.py"))  # argparse would name this file; the usage line names the command
