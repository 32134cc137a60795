"""The registries' metadata: declared for every method, the values worked out by hand from each
function, and each declaration checked against what the function does."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from moe_rl.algos import registry
from moe_rl.algos.advantages import AdvantageInputs, AdvantageSpec
from moe_rl.algos.correction import CorrectionSpec
from moe_rl.algos.losses import PolicyLossSpec
from moe_rl.algos.masking import PolicyMaskSpec
from moe_rl.algos.registry import AdvantageMeta, CorrectionMeta, PolicyLossMeta, PolicyMaskMeta

GAE_PARAMS = frozenset({"gamma", "lam", "lam_critic", "length_adaptive_alpha"})
CLIP = frozenset({"clip_low", "clip_high"})
EXPECTED = {
    "advantage": {
        # whiten: the batch whitening on by default where the estimate needs a batch baseline or scale
        "gae": AdvantageMeta(needs_critic=True, params=GAE_PARAMS, whiten=True),  # reads values_BT
        "reward_to_go": AdvantageMeta(params=frozenset({"gamma"}), whiten=True),  # GAE, V = 0, lambda = 1
        "reinforce": AdvantageMeta(whiten=True),  # batch-mean baseline: no groups
        "rloo": AdvantageMeta(min_group_size=2),  # leave-one-out: a group of one has no baseline
        "grpo": AdvantageMeta(min_group_size=2, params=frozenset({"eps"})),  # std guard eps
        "drgrpo": AdvantageMeta(min_group_size=2),
        "reinforce_pp_baseline": AdvantageMeta(min_group_size=2, whiten=True),  # group mean, batch whitening
        "none": AdvantageMeta(reads_reward=False),  # A = 0: distillation's signal alone
    },
    "correction": {
        "none": CorrectionMeta(reads_behaviour=False),
        "bypass": CorrectionMeta(old_is_behaviour=True),  # pi_old := mu
        "tis_token": CorrectionMeta(params=frozenset({"is_cap"})),
        "tis_seq": CorrectionMeta(params=frozenset({"seq_is_cap"})),
        "icepop": CorrectionMeta(params=frozenset({"icepop_min", "icepop_max"})),
        "geo_tis": CorrectionMeta(params=frozenset({"geo_max"})),  # truncates the geometric mean at geo_max
        "geo_mask": CorrectionMeta(params=frozenset({"geo_min", "geo_max"})),
    },
    "policy_loss": {
        "ppo": PolicyLossMeta(params=CLIP | {"dual_clip"}),
        "gspo": PolicyLossMeta(sequence_level=True, params=CLIP),  # one length-normalised ratio per sequence
        "gmpo": PolicyLossMeta(sequence_level=True, params=CLIP),  # geometric mean over a sequence's tokens
        "cispo": PolicyLossMeta(params=CLIP),  # clips the detached weight
        "sapo": PolicyLossMeta(params=frozenset({"sapo_tau_pos", "sapo_tau_neg"})),  # a soft gate, no clip
    },
    "policy_mask": {
        "none": PolicyMaskMeta(reads_behaviour=False),
        "opsm": PolicyMaskMeta(params=frozenset({"opsm_delta"})),  # mean log(mu / pi_theta) per sequence
        # one selection over the optimizer batch, from log(pi_theta / pi_old)
        "m2po": PolicyMaskMeta(scope="batch", reads_behaviour=False, reads_old=True,
                               params=frozenset({"m2po_tau"})),
    },
}


def test_every_method_has_the_metadata_worked_out_by_hand():
    for kind, expected in EXPECTED.items():
        assert registry.names(kind) == sorted(expected)
        for name, meta in expected.items():
            assert registry.meta(kind, name) == meta, (kind, name)
            assert isinstance(registry.meta(kind, name), registry.META[kind])
    assert [n for n in registry.names("advantage") if registry.meta("advantage", n).needs_groups] == \
        ["drgrpo", "grpo", "reinforce_pp_baseline", "rloo"]
    assert [n for n in registry.names("correction") if registry.meta("correction", n).reweights] == \
        ["geo_mask", "geo_tis", "icepop", "tis_seq", "tis_token"]


def test_metadata_is_frozen_and_checked_at_registration():
    with pytest.raises(dataclasses.FrozenInstanceError):
        registry.meta("advantage", "gae").needs_critic = False
    with pytest.raises(TypeError):
        registry.register("advantage", "x", needs_values=True)  # not an AdvantageMeta field
    with pytest.raises(KeyError, match="unknown registry kind"):
        registry.register("value_loss", "x")
    with pytest.raises(KeyError, match="unknown correction 'tis'; registered: bypass, geo_mask, geo_tis"):
        registry.meta("correction", "tis")


def test_importing_the_registry_alone_registers_every_method():
    code = "from moe_rl.algos import registry; print(*(len(registry.names(k)) for k in registry.KINDS))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(len(EXPECTED[k])) for k in registry.KINDS]


def _advantage_inputs(groups, values: bool) -> AdvantageInputs:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 1, 1], [1, 0, 1, 1, 1]],
                        dtype=torch.bool)
    return AdvantageInputs(
        rewards_BT=torch.randn(4, 5, generator=g) * mask, mask_BT=mask,
        score_B=torch.tensor([1.0, 0.0, 3.0, 0.5]), group_B=torch.tensor(groups),
        values_BT=torch.randn(4, 5, generator=g) if values else None,
        terminated_B=torch.tensor([True, False, True, False]) if values else None,
        boundary_value_B=torch.tensor([0.0, 0.7, 0.0, -0.4]) if values else None)


def _same(a, b) -> bool:
    return all((x is None and y is None)
               or (x is not None and y is not None and torch.allclose(x.double(), y.double()))
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", sorted(EXPECTED["advantage"]))
def test_advantage_metadata_matches_what_the_estimator_reads(name):
    fn, meta = registry.get("advantage", name), registry.meta("advantage", name)
    hp = AdvantageSpec()
    base = fn(_advantage_inputs([0, 0, 1, 1], values=True), hp)
    # needs_critic: without values it refuses; otherwise values change nothing
    if meta.needs_critic:
        with pytest.raises(ValueError, match="needs values_BT"):
            fn(_advantage_inputs([0, 0, 1, 1], values=False), hp)
    else:
        assert _same(fn(_advantage_inputs([0, 0, 1, 1], values=False), hp), base)
    # needs_groups: regrouping changes the advantages; a group of one gets none
    assert _same(fn(_advantage_inputs([0, 1, 0, 1], values=True), hp), base) != meta.needs_groups
    if meta.needs_groups:
        assert not fn(_advantage_inputs([0, 1, 2, 3], values=True), hp)[0].any()
    # params: exactly the declared hyperparameters change the result (advantages or critic targets)
    other = {"gamma": 0.5, "lam": 0.5, "lam_critic": 0.3, "length_adaptive_alpha": 0.5, "eps": 0.5}
    for field in dataclasses.fields(AdvantageSpec):
        changed = fn(_advantage_inputs([0, 0, 1, 1], values=True),
                     dataclasses.replace(hp, **{field.name: other[field.name]}))
        assert _same(changed, base) != (field.name in meta.params), field.name


# two sequences (the first one token shorter) and the log-probs of one policy on them
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
OLD = torch.log(torch.tensor([[0.5, 0.4, 0.2, 0.1], [0.3, 0.3, 0.6, 0.2]]))


@pytest.mark.parametrize("name", sorted(EXPECTED["correction"]))
def test_correction_metadata_matches_what_the_correction_reads(name):
    fn, meta = registry.get("correction", name), registry.meta("correction", name)
    mask, old, hp = MASK, OLD, CorrectionSpec()
    mu = torch.log(torch.tensor([[0.5, 0.1, 0.4, 0.1], [0.3, 0.9, 0.2, 0.2]]))
    a, b = fn(old, mu, mask, hp), fn(old, old, mask, hp)  # mu != pi_old, mu = pi_old
    differs = not (torch.equal(a.weight_BT, b.weight_BT) and torch.equal(a.keep_BT, b.keep_BT))
    assert differs == meta.reweights  # bypass reads mu as pi_old, not as a weight
    # params: exactly the declared hyperparameters change the weights or the kept tokens (caps and bands
    # chosen so that every bound binds on this batch: token weights pi_old/mu from 1/3 to 4, the first
    # sequence's product 2, the geometric means 2^(1/3) = 1.26 and 1)
    hp = CorrectionSpec(is_cap=1.5, seq_is_cap=1.5, icepop_min=0.6, icepop_max=1.6, geo_min=0.99,
                          geo_max=1.2)
    base = fn(old, mu, mask, hp)
    other = {"is_cap": 3.0, "seq_is_cap": 30.0, "icepop_min": 0.3, "icepop_max": 3.0, "geo_min": 1.1,
             "geo_max": 3.0}
    for field in dataclasses.fields(CorrectionSpec):
        c = fn(old, mu, mask, dataclasses.replace(hp, **{field.name: other[field.name]}))
        same = torch.equal(c.weight_BT, base.weight_BT) and torch.equal(c.keep_BT, base.keep_BT)
        assert same != (field.name in meta.params), field.name


@pytest.mark.parametrize("name", sorted(EXPECTED["policy_loss"]))
def test_policy_loss_metadata_matches_what_the_loss_reads(name):
    """Exactly the declared hyperparameters change the loss (token ratios from 0.17 to 1.8, sequence ratios
    1.25 and 0.58, a negative advantage at ratio 1.8: every bound binds)."""
    fn, meta = registry.get("policy_loss", name), registry.meta("policy_loss", name)
    logp = torch.log(torch.tensor([[0.9, 0.35, 0.25, 0.1], [0.05, 0.35, 0.7, 0.1]]))
    adv = torch.tensor([[-1.0, -2.0, 1.0, 0.0], [-1.0, 0.5, -1.5, 0.0]])
    hp = PolicyLossSpec(clip_low=0.1, clip_high=0.1, dual_clip=1.5)
    base, _ = fn(logp, OLD, adv, MASK, hp)
    other = {"clip_low": 0.5, "clip_high": 0.9, "dual_clip": 4.0, "sapo_tau_pos": 2.0, "sapo_tau_neg": 0.5}
    for field in dataclasses.fields(PolicyLossSpec):
        loss, _ = fn(logp, OLD, adv, MASK, dataclasses.replace(hp, **{field.name: other[field.name]}))
        assert torch.equal(loss, base) != (field.name in meta.params), field.name


@pytest.mark.parametrize("name", sorted(EXPECTED["policy_loss"]))
def test_sequence_level_losses_give_each_token_its_sequence_value(name):
    fn, meta = registry.get("policy_loss", name), registry.meta("policy_loss", name)
    mask, old = MASK, OLD
    logp = torch.log(torch.tensor([[0.6, 0.3, 0.25, 0.1], [0.2, 0.35, 0.7, 0.1]]))
    adv = torch.tensor([[1.0], [-0.5]]).expand(2, 4)  # one advantage per sequence
    loss, _ = fn(logp, old, adv, mask, PolicyLossSpec(clip_low=0.1, clip_high=0.1))
    per_sequence = all(torch.allclose(row[m], row[m][0].expand(int(m.sum())))
                       for row, m in zip(loss, mask, strict=True))
    assert per_sequence == meta.sequence_level


@pytest.mark.parametrize("name", sorted(EXPECTED["policy_mask"]))
def test_policy_mask_metadata_matches_what_the_mask_reads(name):
    """reads_behaviour: mu changes the mask; reads_old: pi_old does, and a mask reading it keeps everything
    when pi_theta = pi_old; params: exactly the declared ones change it (the first sequence has a negative
    advantage and drifted from mu by 0.5 a token; log(pi_theta / pi_old) is 0.5 on an active-quadrant
    token)."""
    fn, meta = registry.get("policy_mask", name), registry.meta("policy_mask", name)
    logp = torch.log(torch.tensor([[0.3, 0.3, 0.3, 0.1], [0.5, 0.5, 0.5, 0.5]]))
    mu, old = logp + torch.tensor([[0.5], [0.0]]), logp - torch.tensor([[0.0], [0.5]])
    adv = torch.tensor([[-1.0], [1.0]]).expand(2, 4)
    hp = PolicyMaskSpec(opsm_delta=0.1, m2po_tau=0.01)

    def keep(**kw):
        args = {"logp_BT": logp, "logp_old_BT": old, "logp_mu_BT": mu, "adv_BT": adv, "mask_BT": MASK,
                "hp": hp} | kw
        return fn(*args.values())[0]

    base = keep()
    assert (not keep(logp_mu_BT=logp).equal(base)) == meta.reads_behaviour
    assert (not keep(logp_old_BT=logp).equal(base)) == meta.reads_old
    if meta.reads_old:
        assert keep(logp_old_BT=logp).equal(MASK)
    other = {"opsm_delta": 1.0, "m2po_tau": 1.0}
    for field in dataclasses.fields(PolicyMaskSpec):
        changed = keep(hp=dataclasses.replace(hp, **{field.name: other[field.name]}))
        assert (not changed.equal(base)) == (field.name in meta.params), field.name
