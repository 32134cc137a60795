"""Trajectories -> the training batch, and the per-step target math the driver runs on it
(moe_rl.batch, algos.targets.targets, the policy and value losses of train/objectives.py, step
metrics), on tensors small enough to work by hand."""

import math
from types import SimpleNamespace

import pytest
import torch

from moe_rl import batch as batching
from moe_rl.algos.targets import Scores, boundary_values, state_values, targets
from moe_rl.config import AlgorithmSection, EnvironmentSection, RewardModelSection, RunConfig, TrainerSection
from moe_rl.driver import specs
from moe_rl.metrics import Metrics, reduce_updates
from moe_rl.train.objectives import ValueLoss
from moe_rl.trajectory import Outcome, Trajectory, validate_trajectory


def step_targets(b, alg: AlgorithmSection, token_budget: int, logp_ref=None, critic: bool = False,
                 reward_model=None, rm: RewardModelSection | None = None):
    """algos.targets on batch `b` with the settings of a config holding `alg` (pi_old = mu: a
    synchronous step); a critic that outputs 0 everywhere when `critic`; `reward_model`: its scores [B]."""
    cfg = RunConfig(algorithm=alg, environment=EnvironmentSection(token_budget=token_budget),
                    reward_model=rm or RewardModelSection())
    scores = Scores(b.logp_mu_BS, logp_ref, torch.zeros(b.input_ids_BS.shape) if critic else None,
                    reward_model_B=reward_model)
    return targets(b, scores, specs.target_spec(cfg))


def traj(n_prompt, turns, terminal, group=0, outcome=Outcome.COMPLETED, obs=2):
    """A trajectory: n_prompt prompt tokens, then for each (length, reward) turn `length` model tokens
    followed (except after the last) by `obs` observation tokens."""
    ids, mask, spans, rewards = list(range(1, n_prompt + 1)), [False] * n_prompt, [], []
    for i, (length, r) in enumerate(turns):
        spans.append((len(ids), len(ids) + length - 1))
        ids += [7] * length
        mask += [True] * length
        rewards.append(r)
        if i < len(turns) - 1:
            ids += [9] * obs
            mask += [False] * obs
    logp = [-0.5 if m else 0.0 for m in mask]
    return Trajectory(ids, mask, logp, spans, rewards, terminal, outcome, len(ids), 0, n_prompt,
                      group_id=group)


def test_build_batch_places_rewards_and_pads_by_hand():
    a = traj(2, [(2, -0.05), (1, 0.0)], 1.0)  # P P M M O O M
    b = traj(3, [(1, 0.0)], 0.0, group=1, outcome=Outcome.TRUNCATED_BUDGET)  # P P P M
    b.info["loss_excluded"] = "overlong"
    batch = batching.build_batch([a, b], None)
    assert batch.input_ids_BS.shape == (2, 7) and batch.lengths_B.tolist() == [7, 4]
    assert batch.mask_BS.int().tolist() == [[0, 0, 1, 1, 0, 0, 1], [0, 0, 0, 1, 0, 0, 0]]
    # turn feedback on its span's last token, the terminal reward on the last model token
    assert batch.rewards_BS.equal(torch.tensor([[0, 0, 0, -0.05, 0, 0, 1.0], [0] * 7]))
    # excluded: no policy loss
    assert batch.loss_mask_BS[1].sum() == 0 and batch.loss_mask_BS[0].equal(batch.mask_BS[0])
    assert batch.score_B.tolist() == pytest.approx([0.95, 0.0]) and batch.turns_B.tolist() == [2, 1]
    assert batch.terminated_B.tolist() == [True, False] and batch.prompt_len_B.tolist() == [2, 3]
    sub = batch.rows(torch.tensor([1]))  # cut to the rows' longest length
    assert sub.size == 1 and sub.group_B.tolist() == [1] and sub.rewards_BS.shape == (1, 4)
    assert sub.mask_BS.equal(batch.mask_BS[1:, :4]) and sub.routes_BSLK is None


def test_batch_rows_pad_and_microbatches_keep_every_field_aligned():
    trajs = [traj(2, [(2, 0.0)], 1.0), traj(1, [(1, 0.0)], 0.0), traj(3, [(3, 0.0)], 1.0)]  # lengths 4, 2, 6
    b = batching.build_batch(trajs, None)
    b = batching.Batch(**{**b.__dict__,
                          "routes_BSLK": torch.arange(3 * 6 * 2 * 1, dtype=torch.uint8).reshape(3, 6, 2, 1),
                          "adv_BS": torch.arange(18.0).reshape(3, 6)})
    mbs = b.microbatches(token_budget=8)  # rows 0+1 cost 2 x 4 = 8; row 2 alone (6)
    assert [m.size for m in mbs] == [2, 1] and [m.input_ids_BS.shape[1] for m in mbs] == [4, 6]
    assert mbs[0].routes_BSLK.dtype == torch.uint8 and mbs[0].routes_BSLK.equal(b.routes_BSLK[:2, :4])
    assert mbs[0].adv_BS.equal(b.adv_BS[:2, :4]) and mbs[1].lengths_B.tolist() == [6]
    grown = b.padded(4, 8)
    assert grown.input_ids_BS.shape == (4, 8) and grown.lengths_B.tolist() == [4, 2, 6, 0]
    assert grown.routes_BSLK.shape == (4, 8, 2, 1) and grown.routes_BSLK[:3, :6].equal(b.routes_BSLK)
    assert grown.score_B.tolist() == [1.0, 0.0, 1.0, 0.0]
    uniform = b.uniform_microbatches(2, 2, 6)
    assert [m.input_ids_BS.shape for m in uniform] == [(2, 6), (2, 6)] \
        and uniform[1].lengths_B.tolist() == [6, 0]
    assert b.model_inputs(routes=False).routes_BSLK is None and b.model_inputs().adv_BS is None
    moved = b.to("meta")  # what a trainer rank does with the batch it receives (there: its GPU)
    assert all(getattr(moved, f).device.type == "meta"
               for f in ("input_ids_BS", "lengths_B", "routes_BSLK", "adv_BS",
                                                                  "score_B", "mask_BS"))
    assert moved.routes_BSLK.dtype == torch.uint8


def test_state_values_shift_and_boundary():
    out = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    assert state_values(out).tolist() == [[0, 1, 2, 3], [0, 5, 6, 7]]  # V(s_t) = out[t-1]
    assert boundary_values(out, torch.tensor([4, 2])).tolist() == [4.0, 6.0]  # out[boundary_len - 1]


def _outcome_batch():
    # two samples of one prompt, 2 model tokens each; behaviour log-probs -1, reference -1.5 and -1
    trajs = [traj(1, [(2, 0.0)], 1.0), traj(1, [(2, 0.0)], 0.0)]
    b = batching.build_batch(trajs, None)
    b.logp_mu_BS = torch.where(b.mask_BS, -1.0, 0.0)
    logp_ref = torch.where(b.mask_BS, torch.tensor([[-1.5], [-1.0]]), 0.0)
    return b, logp_ref


def test_kl_reward_shapes_outcome_estimators():
    """grpo with kl_reward_coef: R_i - beta sum_t k1_t. k1 = logp_mu - logp_ref: 0.5 per token for
    sample 0 (sum 1.0), 0 for sample 1; beta 0.2 -> scores 1 - 0.2 = 0.8 and 0; group mean 0.4,
    unbiased std 0.4 sqrt(2) -> advantages +-1/sqrt(2) (eps 1e-6 aside)."""
    b, ref = _outcome_batch()
    alg = AlgorithmSection(advantage="grpo", whiten_advantages=False, kl_reward_coef=0.2)
    t = step_targets(b, alg, 64, ref)
    assert t.returns_BS is None and t.logp_ref_BS is ref
    adv = t.adv_BS
    expected = 0.4 / (0.4 * math.sqrt(2) + 1e-6)
    assert adv[0, 1:].tolist() == pytest.approx([expected] * 2, rel=1e-6)
    assert adv[1, 1:].tolist() == pytest.approx([-expected] * 2, rel=1e-6)
    assert float(t.metrics["reward/kl_penalty_mean"]) == pytest.approx(0.25)
    plain = step_targets(b, AlgorithmSection(advantage="rloo", whiten_advantages=False), 64, ref).adv_BS
    shaped = step_targets(b, AlgorithmSection(advantage="rloo", whiten_advantages=False, kl_reward_coef=0.2),
                          64, ref).adv_BS
    # rloo: A_0 = R_0 - R_1: 1 without the penalty, 0.8 with it
    assert plain[0, 1].item() == pytest.approx(1.0) and shaped[0, 1].item() == pytest.approx(0.8)


def test_a_reward_models_score_combines_with_the_rule_reward_by_weight():
    """Rule rewards 1 and 0 (terminal), reward-model scores 0.5 and 2: with weights rule 2, model 0.5,
    R = 2 * 1 + 0.5 * 0.5 = 2.25 and 2 * 0 + 0.5 * 2 = 1, on each sample's last model token. RLOO then
    reads A_0 = R_0 - R_1 = 1.25; reward-to-go gives every model token its return to go (here R)."""
    b, _ = _outcome_batch()
    rm = RewardModelSection(path="/rm", weight=0.5, rule_weight=2.0)
    scores = torch.tensor([0.5, 2.0])
    t = step_targets(b, AlgorithmSection(advantage="rloo", whiten_advantages=False), 64, reward_model=scores,
                     rm=rm)
    assert t.adv_BS[0, 1:].tolist() == pytest.approx([1.25, 1.25]) \
        and t.adv_BS[1, 1:].tolist() == pytest.approx([-1.25] * 2)
    assert float(t.metrics["reward/model_mean"]) == pytest.approx(1.25)
    assert float(t.metrics["reward/combined_mean"]) == pytest.approx((2.25 + 1.0) / 2)
    rtg = step_targets(b, AlgorithmSection(advantage="reward_to_go", whiten_advantages=False), 64,
                       reward_model=scores, rm=rm)
    assert rtg.adv_BS[:, 1:].flatten().tolist() == pytest.approx([2.25, 2.25, 1.0, 1.0])
    without = step_targets(b, AlgorithmSection(advantage="rloo", whiten_advantages=False), 64)
    assert without.adv_BS[0, 1:].tolist() == pytest.approx([1.0, 1.0]) \
        and "reward/model_mean" not in without.metrics


@pytest.mark.parametrize("advantage", ["gae", "reward_to_go", "grpo"])
def test_overlong_penalty_reaches_every_estimator(advantage):
    """Episode lengths after the prompt: 2 and 8 tokens (model + observation); token_budget 8, buffer 4:
    R_len = 0 for the first, (4 - 8) / 4 = -1 for the second, on its last model token."""
    short = traj(1, [(2, 0.0)], 0.5)
    long = traj(1, [(2, 0.0), (2, 0.0), (2, 0.0)], 0.5, obs=1)  # 2+1+2+1+2 = 8 tokens after the prompt
    b = batching.build_batch([short, long], None)
    assert (b.lengths_B - b.prompt_len_B).tolist() == [2, 8]
    kw = dict(advantage=advantage, whiten_advantages=False, gamma=1.0, lam=1.0)
    base = step_targets(b, AlgorithmSection(**kw), 8, critic=True).adv_BS
    t = step_targets(b, AlgorithmSection(**kw, overlong_buffer=4), 8, critic=True)
    pen, m = t.adv_BS, t.metrics
    first = b.mask_BS.float().argmax(1)
    if advantage == "grpo":  # one group; scores 0.5, 0.5 -> all 0; penalised 0.5, -0.5 -> +-1/sqrt(2)
        assert base.abs().max() == 0
        assert [pen[i, first[i]].item() for i in (0, 1)] == pytest.approx([2**-0.5, -(2**-0.5)], rel=1e-5)
    else:  # gamma = lambda = 1, V = 0: the first action's advantage is the whole return, 0.5 or 0.5 - 1
        assert pen[0, first[0]].item() == pytest.approx(0.5) \
            and base[0, first[0]].item() == pytest.approx(0.5)
        assert pen[1, first[1]].item() == pytest.approx(-0.5) \
            and base[1, first[1]].item() == pytest.approx(0.5)
    assert float(m["reward/overlong_penalty_mean"]) == pytest.approx(-0.5)


def _policy_mb(weight, adv=0.0):
    mask = torch.tensor([[True, True, False]])
    return SimpleNamespace(pg_mask_BS=mask, loss_mask_BS=mask, adv_BS=torch.full((1, 3), adv),
                           logp_old_BS=torch.tensor([[-1.0, -2.0, 0.0]]),
                           is_weight_BS=torch.full((1, 3), weight),
                           logp_ref_BS=torch.tensor([[-1.5, -1.0, 0.0]]))


def test_importance_weight_multiplies_the_policy_term_only():
    """With advantage 0 only the KL term is left: doubling w must not change it. k3 at
    d = logp_ref - logp = (-0.5, +1): e^d - d - 1 = 0.10653 and 0.71828; beta 0.1."""
    fn = specs.policy_loss(RunConfig(algorithm=AlgorithmSection(kl_loss_coef=0.1, kl_loss_estimator="k3"),
                                        trainer=TrainerSection(proximal_pass="separate")))  # logp_old given
    out = {"logp_BS": torch.tensor([[-1.0, -2.0, 0.0]]), "entropy_BS": torch.zeros(1, 3)}
    one, _ = fn(out, _policy_mb(1.0))
    two, _ = fn(out, _policy_mb(2.0))
    k3 = (math.exp(-0.5) + 0.5 - 1) + (math.exp(1) - 1 - 1)
    assert float(one["regularizer"]) == pytest.approx(0.1 * k3) \
        and float(two["regularizer"]) == float(one["regularizer"])
    assert float(one["policy"]) == 0.0
    # the policy term itself is weighted: with A = 1 (ratio 1, unclipped) its numerator is -w per token
    one, _ = fn(out, _policy_mb(1.0, adv=1.0))
    two, _ = fn(out, _policy_mb(2.0, adv=1.0))
    assert float(one["policy"]) == pytest.approx(-2.0) and float(two["policy"]) == pytest.approx(-4.0)


def test_value_loss_regresses_shifted_values():
    """out = (0.1, 0.2, 0.3): V(s_1) = 0.1, V(s_2) = 0.2 on model tokens 1, 2; returns 1 and 0:
    1/2 ((0.1 - 1)^2 + (0.2 - 0)^2) = 0.425 (no clipping)."""
    mb = SimpleNamespace(mask_BS=torch.tensor([[False, True, True]]),
                         returns_BS=torch.tensor([[0.0, 1.0, 0.0]]), values_old_BS=torch.zeros(1, 3))
    num, metrics = ValueLoss(None)({"critic_out_BS": torch.tensor([[0.1, 0.2, 0.3]])}, mb)
    assert float(num) == pytest.approx(0.425) and float(metrics["value_mean"]) == pytest.approx(0.15)


def test_non_finite_rewards_are_rejected_by_name():
    t = traj(1, [(2, float("nan"))], 1.0)
    assert any(p.startswith("rewards:") for p in validate_trajectory(t))
    t = traj(1, [(2, 0.0)], float("inf"))
    assert any(p.startswith("rewards:") for p in validate_trajectory(t))
    assert validate_trajectory(traj(1, [(2, 0.0)], 1.0)) == []


def test_step_metrics_reduce_over_updates():
    ups = [{"loss": 1.0, "ratio_max": 1.5, "ratio_min": 0.9},
           {"loss": 3.0, "ratio_max": 1.2, "ratio_min": 0.7, "x": 2}]
    assert reduce_updates(ups) == {"loss": 2.0, "ratio_max": 1.5, "ratio_min": 0.7, "x": 2.0}


def test_tensorboard_every_n_steps_under_the_run_name(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = Metrics(tmp_path / "tb" / "myrun", total_steps=5, progress=False, every=2)
    for step in range(1, 6):
        m.log(step, {"reward/mean": float(step)})
    m.close()
    acc = EventAccumulator(str(tmp_path / "tb" / "myrun"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [2, 4, 5]  # every 2, and the last step


def test_a_steps_targets_reach_the_batch_under_their_own_names():
    """One name per tensor: each field a step's targets fill is a field of Targets and of Batch alike."""
    import dataclasses

    from moe_rl.algos.targets import Targets
    from moe_rl.batch import TARGET_FIELDS, Batch

    batch_fields, target_fields = {f.name
                                   for f in dataclasses.fields(Batch)}, {f.name
                                                                         for f in dataclasses.fields(Targets)}
    assert set(TARGET_FIELDS) <= batch_fields & target_fields, \
        set(TARGET_FIELDS) - (batch_fields & target_fields)
