"""What the lent GPU machine lacks is absent here too: vLLM, Transformer Engine, apex and Ray.

tools/gpu_check.sh --dry-run puts this folder first on PYTHONPATH, so every Python process of the dry
run (pytest, the ranks it spawns) starts without them, as the GPU check will, whatever this environment
has installed. A None in sys.modules is Python's own way to say so: `import vllm` raises
ModuleNotFoundError and `importlib.util.find_spec("vllm")` answers None, as where it is not installed.
"""

import sys

for name in ("vllm", "transformer_engine", "apex", "ray"):
    sys.modules[name] = None
