"""Expert-load figures from routes counted by hand, through the metrics writer into real TensorBoard
event files and back: scalars, the heatmap image, histograms."""

import math
from types import SimpleNamespace

import pytest
import torch
from glossary_check import assert_tags_in_glossary

from moe_rl.algos import stats
from moe_rl.algos.targets import Scores
from moe_rl.metrics import Metrics, expert_load_figures


def hand_routes():
    """2 rows, 3 positions, 2 layers, top-2 of 4 experts; row 1's last position is padding (its ids,
    3 and 3, must not count). Valid: 5 positions -> 10 (token, slot) pairs per layer."""
    r = torch.zeros(2, 3, 2, 2, dtype=torch.uint8)
    # layer 0: expert 0 in every slot-0, expert 1 in every slot-1 -> loads [.5, .5, 0, 0]
    r[..., 0, 0], r[..., 0, 1] = 0, 1
    # layer 1: expert 2 six times, expert 3 four times over the valid pairs
    r[0, :, 1] = torch.tensor([[2, 3], [2, 3], [2, 2]])
    r[1, :2, 1] = torch.tensor([[2, 3], [2, 3]])
    r[1, 2] = 3  # padding
    valid = torch.tensor([[True, True, True], [True, True, False]])
    return r, valid


def test_expert_load_imbalance_and_entropy_by_hand():
    routes, valid = hand_routes()
    load = stats.expert_load(routes, valid, num_experts=4)
    assert torch.equal(load, torch.tensor([[0.5, 0.5, 0, 0], [0, 0, 0.6, 0.4]], dtype=torch.float64))
    # max / (1/4)
    assert torch.allclose(stats.load_imbalance(load), torch.tensor([2.0, 2.4], dtype=torch.float64))
    h1 = -(0.6 * math.log(0.6) + 0.4 * math.log(0.4)) / math.log(4)
    assert torch.allclose(stats.usage_entropy(load), torch.tensor([0.5, h1], dtype=torch.float64))
    even = torch.full((1, 4), 0.25, dtype=torch.float64)
    assert float(stats.load_imbalance(even)) == 1.0 and float(stats.usage_entropy(even)) == pytest.approx(1.0)


def test_expert_load_reaches_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    routes, valid = hand_routes()
    figures = expert_load_figures("rollout", stats.expert_load(routes, valid, 4), "rollout (vLLM)")
    m = Metrics(tmp_path, progress=False, total_steps=2, heatmap_every=2)
    for step in (1, 2):
        m.log(step, {**figures, "hist/reward/score": torch.tensor([0.0, 1.0, 1.0])})
    m.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "histograms": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("moe/rollout_load_imbalance_max")] == pytest.approx([2.4, 2.4])
    assert [e.value for e in acc.Scalars("moe/rollout_layer00_load_imbalance")] == pytest.approx([2.0, 2.0])
    images = acc.Images("moe/expert_load")
    assert [i.step for i in images] == [2]  # heatmap_every=2
    assert images[0].height >= 150 and images[0].width >= 250  # a labelled figure (tests/test_plots.py)
    assert_tags_in_glossary(tmp_path)
    hist = acc.Histograms("reward/score")
    assert [h.step for h in hist] == [1, 2] and hist[0].histogram_value.num == 3 \
        and hist[0].histogram_value.sum == 2


def test_progress_bar_starts_after_the_first_step_and_ends_with_the_last(tmp_path, capsys):
    """The bar appears at step 1 already done (its one-time costs outside the rate and the time left)
    and is closed at the last step (evaluation and saving are not steps)."""
    import time

    m = Metrics(tmp_path, enabled=False, total_steps=3, progress=True)
    time.sleep(1.0)  # step 1's one-time costs (engine warm-up, first compilations)
    m.log(1, {"reward/mean": 0.5})
    assert m.bar.n == 1 and m.bar.format_dict["rate"] is None
    m.log(2, {"reward/mean": 0.5})
    assert m.bar.format_dict["elapsed"] < 0.9  # the bar's clock (its rate, the time left) starts after step 1
    m.log(3, {"reward/mean": 0.5})
    assert m.bar.n == 3 and m.bar.disable  # closed at the last step
    err = capsys.readouterr().err
    assert "RL steps" in err and "3/3" in err


def test_step_expert_load_counts_only_positions_the_engine_computed():
    """A truncated episode ends with an observation the engine never computed: build_batch gives those
    positions placeholder routes (experts 0..K-1), which the step's expert load must not count."""
    import numpy as np

    from moe_rl.batch import build_batch
    from moe_rl.metrics import step_figures
    from moe_rl.trajectory import Outcome, RoutingRecord, Trajectory

    def episode(n_obs_tail: int, expert: int) -> Trajectory:
        # 2 prompt tokens, 2 model tokens, then n_obs_tail observation tokens; 1 layer, top-2 of 4 experts
        ids = [1, 2, 5, 6] + [9] * n_obs_tail
        mask = [False, False, True, True] + [False] * n_obs_tail
        computed = 3  # the engine computed positions 0..2 (the last model token was sampled, never read)
        experts = np.zeros((computed, 1, 2), dtype=np.uint8)
        experts[..., 0], experts[..., 1] = expert, 3
        t = Trajectory(ids, mask, [0.0] * len(ids), [(2, 3)], [0.0], 0.0, Outcome.TRUNCATED_TURNS, 4, 0, 2)
        t.routes = RoutingRecord(experts, np.ones(computed, dtype=bool))
        return t

    b = build_batch([episode(4, 2), episode(0, 2)], top_k=2)
    # placeholders
    assert b.routed_len_B.tolist() == [3, 3] and b.routes_BSLK[0, 3:, 0].tolist() == [[0, 1]] * 5
    scores = Scores(b.logp_mu_BS)  # the policy alone: no free routing, no teacher
    tg = SimpleNamespace(adv_BS=torch.zeros(b.input_ids_BS.shape), metrics={}, returns_BS=None)
    out = step_figures(b, scores, tg, num_experts=4)
    # 6 computed positions x 2 slots: expert 2 six times, expert 3 six times; placeholders (0, 1) uncounted
    assert out["heatmap/moe/expert_load/rollout (vLLM)"].tolist() == [[0.0, 0.0, 0.5, 0.5]]
    assert float(out["moe/rollout_load_imbalance_max"]) == 2.0
    assert float(out["moe/rollout_layer00_usage_entropy"]) == pytest.approx(0.5)
    assert float(out["routing/filled_tail_positions_per_sample"]) == pytest.approx((5 + 1) / 2)


def test_evaluation_figures_count_lost_samples_as_failures():
    """2 prompts x 2 samples; one sample of prompt 1 was lost to an environment error. The success of
    an episode is its `success` figure where it has one (the first: 0 despite a reward of 0.1), else a
    terminal reward > 0. Success [[0, 1], [1, lost]]: success rate 2/4, pass@1 1/2, pass@2 (each prompt
    has a success) 1; the reward mean is over the 3 scored samples."""
    from moe_rl.metrics import evaluation_figures
    from moe_rl.trajectory import Outcome, Trajectory

    def episode(group, sample, terminal, figures=None):
        t = Trajectory([1, 2], [False, True], [0.0, -1.0], [(1, 1)], [0.0], terminal, Outcome.COMPLETED, 2, 0,
                       1, group_id=group, sample_index=sample)
        t.info["figures"] = figures or {}
        return t

    figures = evaluation_figures([episode(0, 0, 0.1, {"success": 0.0}), episode(0, 1, 1.0),
                                  episode(1, 0, 1.0)],
                                 prompts=2, samples=2)
    assert figures["eval/success_rate"] == figures["eval/mean@2"] == 0.5
    assert figures["eval/pass@1"] == pytest.approx(0.5) and figures["eval/pass@2"] == pytest.approx(1.0)
    assert figures["eval/reward_mean"] == pytest.approx(2.1 / 3) and figures["eval/rejected"] == 1
    nothing = evaluation_figures([], prompts=2, samples=2)
    assert math.isnan(nothing["eval/reward_mean"]) and nothing["eval/pass@2"] == 0.0


def test_the_closing_lines_name_the_best_step_and_say_when_rl_ended_below_the_start(tmp_path, capsys):
    from moe_rl.driver.report import report

    def ev(r):
        return {"eval/reward_mean": r, "eval/success_rate": r}

    report(tmp_path, {}, {0: ev(0.3), 5: ev(0.25), 10: ev(0.2)}, [], 10)
    out = capsys.readouterr().out
    assert ("best evaluation: step 5 (held-out reward 0.250, below the 0.300 before RL; checkpoint not "
            "kept)") in out
    assert "held-out reward: 0.300 -> 0.200   success rate: 0.300 -> 0.200" in out
    report(tmp_path, {}, {0: ev(0.1), 5: ev(0.25)}, [], 5)
    assert "best evaluation: step 5 (held-out reward 0.250; checkpoint not kept)" in capsys.readouterr().out


def test_the_closing_lines_and_the_summary_hold_the_baselines(tmp_path, capsys):
    import json

    from moe_rl.driver.report import report

    def ev(r):
        return {"eval/reward_mean": r, "eval/success_rate": r}

    baselines = {"random guesses": ev(0.376), "binary search": ev(1.0)}
    report(tmp_path, {}, {0: ev(0.4), 3: ev(0.9)}, [], 3, baselines)
    out = capsys.readouterr().out
    assert "baselines on the same held-out prompts, success rate: random guesses 0.376, binary search 1.000" \
        in out
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["baselines"] == baselines and saved["eval/success_rate_after"] == 0.9


def test_the_timeline_is_a_chrome_trace_with_each_rollout_on_a_track_of_its_own(tmp_path):
    import json

    from moe_rl.metrics import Timeline

    tl = Timeline()
    tl.mark("generate", 0)
    with tl.span("wait", 0):
        pass
    with tl.span("update", 0), tl.span("score", 0):
        pass
    with pytest.raises(KeyboardInterrupt), tl.span("save", 1):  # the run stopped inside it
        raise KeyboardInterrupt
    span_ends = [e[3] for e in tl.events]
    assert tl.names() == ["generate 0", "wait 0", "update 0", "score 0", "save 1"]
    trace = json.loads(tl.write(tmp_path / "timeline.json").read_text())["traceEvents"]
    driver = [e for e in trace if e["tid"] == 0 and e["ph"] != "M"]
    assert [(e["name"], e["ph"], e["args"]) for e in driver] == [
        ("generate", "i", {"step": 0}), ("wait", "X", {"step": 0}), ("update", "X", {"step": 0}),
        ("score", "X", {"step": 0}), ("save", "X", {"step": 1})]
    assert all(end is not None for end in span_ends)  # ended even by the interrupt
    update, score = driver[2], driver[3]  # nested: the score inside the update
    assert update["ts"] <= score["ts"] and score["ts"] + score["dur"] <= update["ts"] + update["dur"]
    # submitted at the mark, in hand at the wait's end
    (rollout,) = [e for e in trace if e["tid"] == 1 and e["ph"] != "M"]
    wait = driver[1]
    assert rollout["name"] == "rollout 0" and rollout["ts"] == driver[0]["ts"]
    assert rollout["ts"] + rollout["dur"] == pytest.approx(wait["ts"] + wait["dur"], abs=0.2)
    assert {e["args"]["name"] for e in trace if e["ph"] == "M"} == {"driver", "rollouts"}


def test_a_span_the_run_never_left_is_written_open(tmp_path):
    import json

    from moe_rl.metrics import Timeline

    tl = Timeline()
    cm = tl.span("wait", 3)
    cm.__enter__()  # a hang: the timeline is written (loop.run's finally) while the wait has not ended
    trace = json.loads(tl.write(tmp_path / "timeline.json").read_text())["traceEvents"]
    assert [(e["name"], e["ph"]) for e in trace if e["tid"] == 0 and e["ph"] != "M"] == [("wait", "B")]
    assert not [e for e in trace if e["tid"] == 1 and e["ph"] != "M"]  # no rollout span without its end
