import os
import sys

# gpu_cases is imported by name inside spawned workers too.
sys.path.insert(0, os.path.dirname(__file__))
