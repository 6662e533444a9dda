import os
import sys

# Workers started by spawn import the engines by module name: keep this folder importable.
sys.path.insert(0, os.path.dirname(__file__))
