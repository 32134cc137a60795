"""The config documents itself: every section and setting has its description where it is declared,
docs/config.md is generated from them (and current), `moe-rl config explain` answers from them, and the
config's parallel layout rule is the trainer's."""

import itertools

import pytest
from cli_runs import run_main
from conftest import ROOT

from moe_rl.config import docs as config_docs
from moe_rl.config import from_dict
from moe_rl.schema import ConfigError


def test_every_section_and_setting_is_described():
    undescribed = [f.path for f in config_docs.fields() if not f.doc.strip()]
    assert not undescribed, f"settings without a docstring under them: {undescribed}"
    assert all((cls.__doc__ or "").strip() for cls in config_docs.sections().values())
    assert len(config_docs.fields()) > 100 and "model.tiny.top_k" in {f.path for f in config_docs.fields()}


def test_docs_config_md_is_generated_from_them():
    on_disk = (ROOT / "docs" / "config.md").read_text()
    assert on_disk == config_docs.markdown(), "docs/config.md is stale: moe-rl config docs > docs/config.md"


def test_explain_a_setting_a_section_and_a_typo():
    out = run_main("config", "explain", "rollout.temperature", expect=0).stdout
    assert out.startswith("rollout.temperature: float (default 1.0)") and "Sampling temperature" in out
    out = run_main("config", "explain", "algorithm.aggregation", expect=0).stdout
    assert "one of 'token_mean', 'seq_mean', 'seq_sum_const' (default \"token_mean\")" in out
    out = run_main("config", "explain", "model", expect=0).stdout
    assert '  path: str (default "")' in out
    assert "  tiny: a section (moe-rl config explain model.tiny)" in out
    bad = run_main("config", "explain", "rollout.temprature", expect=2)
    assert "rollout.temprature: no such setting (did you mean 'rollout.temperature'?)" in bad.stderr


def test_the_config_and_the_trainer_refuse_the_same_layouts_for_the_same_reason():
    """parallel.* is checked by config.run.layout_problem, and so is train.parallel.Layout: over every
    small layout, the config refuses exactly what the trainer refuses, naming the same reason."""
    from moe_rl.train.parallel import Layout

    refused, reasons = 0, set()
    for world, tp, pp, cp, ep, etp in itertools.product((1, 2, 3, 4, 6, 8), (1, 2, 4), (1, 2), (1, 2),
                                                        (1, 2, 4), (None, 1, 2)):
        try:
            Layout(tp=tp, pp=pp, ep=ep, cp=cp, etp=etp).check(world)
            trainer = None
        except ValueError as err:
            trainer = str(err)
        try:
            layout = {"world_size": world, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp}
            from_dict({"parallel": layout}, cuda_available=True)
            config = None
        except ConfigError as err:
            config = str(err)
            if not config.startswith(("parallel.world_size", "parallel.ep", "parallel.etp")):
                continue  # another section's rule (a cross-section check): not the layout's
        assert (trainer is None) == (config is None), (world, tp, pp, cp, ep, etp, trainer, config)
        if trainer:
            refused += 1
            reasons.add(trainer.split(":")[0])
            assert config == "parallel." + trainer, (config, trainer)
    assert refused > 50 and reasons == {"world_size", "ep", "etp"}, reasons


@pytest.mark.parametrize("path", ["rollout", "model.tiny", "cluster.offload"])
def test_explain_answers_from_the_declaring_class(path):
    out = config_docs.explain(path)
    assert out.split(":", 1)[0] == path and len(out.splitlines()) >= 3
