"""tools/lr_sensitivity.py, which compares how far one optimizer step on each parameter group moves a
model (the figures behind configs/quickstart_deepseek.yaml's trainer.lr_mult): for a small step on the
output layer (no routing decision after it to flip) the KL is second order in the step, so halving that
group's rate (--mult) quarters its KL; a factor of 0 on every group leaves the model as it was; the
command prints a table."""

import subprocess
import sys

from conftest import ROOT


def test_a_groups_kl_is_quadratic_in_its_step_and_the_command_prints_the_table(tiny_qwen):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import lr_sensitivity
    finally:
        sys.path.pop(0)
    full, _ = lr_sensitivity.sensitivities(str(tiny_qwen), 1e-3, {})
    half, _ = lr_sensitivity.sensitivities(str(tiny_qwen), 1e-3, {"lm_head": 0.5})
    full, half = ({name: value for value, name, _ in rows} for rows in (full, half))
    assert set(full) == set(half) and "layers.0.mlp.experts.gate_up_proj" in full  # experts: one group
    assert abs(half["lm_head"] / full["lm_head"] - 0.25) < 0.01
    assert half["embed_tokens"] == full["embed_tokens"] > 0
    assert lr_sensitivity.sensitivities(str(tiny_qwen), 1e-3, {"*": 0.0})[1] == 0.0
    out = subprocess.run([sys.executable, "tools/lr_sensitivity.py", str(tiny_qwen), "--top", "3"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].endswith("(lr 0.0015): KL x 1e-4 after a step on one group") and len(out) == 5
    assert out[-1].startswith("  all groups at once: ")
