"""Megatron-core trainers: model building, parallel state, scoring, updates, checkpoints, conversion.

Importing this package silences two warnings megatron-core gives on every import where they do not
apply: that Transformer Engine / apex are absent (the local layer spec is meant to run without them)
and that its own default CUDA-graph scope is deprecated.
"""

import importlib.util
import warnings

if importlib.util.find_spec("transformer_engine") is None:
    warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed")
warnings.filterwarnings("ignore", message=r"full scope is deprecated")
