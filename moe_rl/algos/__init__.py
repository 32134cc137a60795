"""Pure RL math: torch only — no megatron, vllm, ray or config objects.

Modules: gae (masked model-token GAE), advantages (registered estimators, whitening), rewards
(placement, KL shaping, overlong penalty), losses (registered policy losses, value, KL, entropy),
correction (registered off-policy corrections, ESS, staleness), masking (registered trust masks of
the policy-gradient term: OPSM, M2PO), aggregate (loss numerators and global
denominators), anchor (PPO-EWMA), checks (the pre-update checklist, finite-sample filter), stats
(diagnostics).

Conventions: tensors are [B, T] (samples x raw positions) unless named otherwise; values at mask-0
positions are never read (selected away with torch.where, so NaN/inf there is harmless); losses and
corrections compute in float32 at least (bf16/fp16 inputs are upcast, float64 stays float64).

Importing the package imports the method modules, whose @register calls fill `registry`.
"""

from moe_rl.algos import advantages, correction, losses, masking  # noqa: F401
