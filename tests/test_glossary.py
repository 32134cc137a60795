"""The metric glossary (moe_rl/glossary.py): every logged scalar described, with its unit; docs/metrics.md
generated from it (and current); an undescribed tag fails. The tests that run training check their runs'
tags against it (tests/glossary_check.py)."""

import pytest
from cli_runs import run_main
from conftest import ROOT
from glossary_check import assert_tags_in_glossary

from moe_rl import glossary


def test_every_entry_has_a_unit_and_a_meaning():
    assert len(glossary.ENTRIES) > 100
    assert len({e.tag for e in glossary.ENTRIES}) == len(glossary.ENTRIES), "a tag described twice"
    for e in glossary.ENTRIES:
        assert e.unit.strip() and e.meaning.strip().endswith("."), e
        assert e.section in glossary.SECTIONS, e


def test_docs_metrics_md_is_generated_from_it():
    on_disk = (ROOT / "docs" / "metrics.md").read_text()
    assert on_disk == glossary.markdown(), "docs/metrics.md is stale: moe-rl metrics docs > docs/metrics.md"


@pytest.mark.parametrize("tag", ["policy/loss", "env/success", "env/lookups", "rollout/outcome_completed",
                                 "rollout/rejected_env_error", "moe/rollout_layer03_usage_entropy",
                                 "memory/teacher_small_rss_gib_max", "memory/engine_gpu_peak_gib_max",
                                 "eval/pass@4", "eval/mean@8", "correction/ess_frac_seq_truncated",
                                 "rollout/gateway_prefix_breaks"])
def test_a_family_describes_its_members(tag):
    assert glossary.describe(tag) is not None and glossary.undescribed([tag]) == []


@pytest.mark.parametrize("tag", ["policy/made_up_figure", "made_up/loss", "moe/rollout_layer3_load_imbalance",
                                 "moe/engine_load_imbalance_max", "rollout/outcome_exploded",
                                 "rollout/gateway_made_up", "eval/pass@k", "memory/policy_made_up_gib"])
def test_an_unknown_tag_is_not_described(tag):
    assert glossary.describe(tag) is None and glossary.undescribed([tag, "policy/loss"]) == [tag]


def test_a_run_logging_an_unknown_tag_fails_the_check(tmp_path):
    from moe_rl.metrics import Metrics

    m = Metrics(tmp_path, total_steps=1, progress=False)
    m.log(1, {"reward/mean": 1.0, "policy/made_up_figure": 2.0})
    m.close()
    with pytest.raises(AssertionError, match=r"not in the metric glossary: \['policy/made_up_figure'\]"):
        assert_tags_in_glossary(tmp_path)


def test_explain_a_tag_a_family_member_and_an_unknown_one():
    out = run_main("metrics", "explain", "timing/step_s", expect=0).stdout
    assert out.startswith("timing/step_s: s\n") and "Wall time of the step" in out
    out = run_main("metrics", "explain", "env/success", expect=0).stdout
    assert out.startswith("env/success (of the family env/{key}): ")
    bad = run_main("metrics", "explain", "policy/made_up", expect=2)
    assert "policy/made_up: not a metric the glossary knows" in bad.stderr
