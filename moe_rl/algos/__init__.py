"""Pure RL math: torch only — no megatron, vllm, ray or config objects.

Modules: gae (masked model-token GAE), advantages (registered estimators, whitening), rewards
(placement, KL shaping, overlong penalty), losses (registered policy losses, value, KL, entropy),
correction (registered off-policy corrections, ESS, staleness), aggregate (global denominators),
anchor (PPO-EWMA), checks (the pre-update checklist), stats (diagnostics).
"""
