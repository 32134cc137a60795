"""The models a step trains and scores with: the policy, the critic and the reference, each a group of
Megatron ranks (cluster.TrainerGroup), and the update loops they own.

    models = Models(cfg, place, model_path)
    scores = models.score(batch, diagnostics)       # DP-sharded forward passes, routes replayed
    figures, logp = models.fit(batch, targets, step)  # critic.fit, then policy.fit: epochs x minibatches
"""

from __future__ import annotations

import dataclasses
import time

import torch

from moe_rl import settings
from moe_rl.algos import aggregate
from moe_rl.algos.targets import Scores, Targets, boundary_values, correct, policy_denominators
from moe_rl.batch import Batch
from moe_rl.cluster import Placement, TrainerGroup
from moe_rl.config import RunConfig
from moe_rl.metrics import reduce_updates, role_figures
from moe_rl.train.objectives import SftLoss


def update_rows(cfg: RunConfig, n: int, dp: int, step: int) -> list[torch.Tensor]:
    """The rows of each update of a step, epoch after epoch: a random split of n rows (seeded by the
    step, the same in every epoch) into trainer.minibatches minibatches, at most n // dp of them so
    every data-parallel replica gets a row of each."""
    k = max(1, min(cfg.trainer.minibatches, n // dp))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.run.seed * 7919 + step))
    return [perm[i::k] for i in range(k)] * cfg.trainer.epochs


class PolicyGroup(TrainerGroup):
    def __init__(self, cfg: RunConfig, place: Placement, slot: str, spec, seed: int):
        super().__init__(cfg, place, slot, spec, "policy", settings.optim_settings(cfg, cfg.trainer.lr), seed,
                         trains=slot != "reference")
        self.cfg, self.loss, self.params = cfg, settings.policy_loss(cfg), settings.target_params(cfg)

    def fit(self, batch: Batch, t: Targets, step: int) -> tuple[dict[str, float], torch.Tensor | None]:
        """Epochs x minibatches of policy updates; the step's policy/ and correction/ figures, and with
        RunConfig.proximal_from_update the policy's log-probs before the update ([B, S], routes
        replayed: the update's own forward), else None.

        Under PPO-EWMA update n uses pi_{theta_bar_{n-1}}, the anchor as it is after the previous
        update: it is scored, and the correction recomputed, per minibatch (guide 000 section 7.2)."""
        cfg, p, t0 = self.cfg, self.params, time.perf_counter()
        full = batch.with_targets(t)
        updates, corrections, skipped, gap = [], [], 0, None
        logp = torch.zeros(batch.input_ids_BS.shape) if cfg.proximal_from_update else None
        for rows in update_rows(cfg, batch.size, self.dp, step):
            mb = full.rows(rows)
            if p.ewma_anchor:
                old = self.score(mb.model_inputs(), anchor=True)["logp"]
                c = correct(old, mb.logp_mu_BS, mb.mask_BS, p)
                corrections.append(c.metrics)
                if gap is None:  # the anchor vs the policy at the start of the step
                    gap = float(((old - t.logp_policy_BS[rows][:, :old.shape[1]]).abs() * mb.mask_BS).sum()
                                / mb.mask_BS.sum().clamp(min=1))
                mb = dataclasses.replace(mb, logp_old_BS=old, is_weight_BS=c.weight_BT,
                                         pg_mask_BS=mb.loss_mask_BS & c.keep_BT)
            denominators = policy_denominators(mb.pg_mask_BS, mb.loss_mask_BS, mb.is_weight_BS, p)
            trained = float(denominators["policy"]) > 0
            if trained:
                updates.append(self.train(mb, self.loss, denominators, keep_logp=logp is not None))
            else:  # nothing kept (or NaN): a skip, never an epsilon
                skipped += 1
            if logp is not None:  # pi_old from the update's forward, or (no update) a pass of its own
                kept = updates[-1].pop("logp") if trained else self.score(mb.model_inputs())["logp"]
                logp[rows, :kept.shape[1]] = kept
        out = role_figures("policy", updates)
        out["policy/skipped_nonfinite"] = sum(u["skipped_nonfinite"] for u in updates)  # a count, not a mean
        out.update({f"correction/{k}": v for k, v in reduce_updates(corrections).items()})
        out.update({"policy/skipped_minibatches": skipped, "timing/actor_train_s": time.perf_counter() - t0})
        if gap is not None:
            out["policy/anchor_logp_gap"] = gap
        return out, logp

    def warm_start(self, batches: list[Batch], lr: float) -> dict[str, float]:
        """Supervised steps on demonstration batches at learning rate `lr`; their figures (warm_start/:
        the first and last NLL, the steps, the learning rate the optimizer used)."""
        from tqdm import tqdm

        self.call("set_lr", lr)
        updates = [self.train(b, SftLoss(), b.mask_BS.sum().double())
                   for b in tqdm(batches, desc="warm start", unit="step", disable=not self.cfg.logging.progress_bar, leave=False)]
        self.call("set_lr", self.cfg.trainer.lr)
        nll = [u.get("nll", float("nan")) for u in updates]
        return {"warm_start/nll_first": nll[0], "warm_start/nll_last": nll[-1], "warm_start/steps": len(nll),
                "warm_start/lr": updates[-1]["lr"]}

    def init_anchor(self) -> None:
        """theta_bar_0 := theta_0 (PPO-EWMA), when the algorithm anchors to an EWMA of the policy."""
        if self.params.ewma_anchor:
            self.call("init_anchor", self.cfg.algorithm.ewma_decay)


class CriticGroup(TrainerGroup):
    def __init__(self, cfg: RunConfig, place: Placement, spec, seed: int):
        # critic.init_from: the policy's checkpoint, or another one (a reward model: its score head
        # becomes the value head). The critic routes freely: replaying the policy's rollout routes
        # would force another model's (possibly differently shaped) routers onto the policy's choices.
        source = None if cfg.critic.init_from == "policy" else cfg.critic.init_from
        spec = dataclasses.replace(spec, hf_path=source or spec.hf_path, routing_replay=False)
        super().__init__(cfg, place, "critic", spec, "critic", settings.optim_settings(cfg, cfg.critic.lr), seed,
                         value_head_from=source)
        self.cfg, self.path, self.loss = cfg, spec.hf_path, settings.value_loss(cfg)

    def fit(self, batch: Batch, t: Targets, step: int) -> dict[str, float]:
        """Epochs x minibatches of value regression to the returns; the step's critic/ figures."""
        cfg, t0 = self.cfg, time.perf_counter()
        full = dataclasses.replace(batch.with_targets(t), routes_BSLK=None)  # the critic routes freely
        updates = []
        for rows in update_rows(cfg, batch.size, self.dp, step):
            mb = full.rows(rows)
            denominator = aggregate.loss_denominator(mb.mask_BS, "token_mean")
            if float(denominator) > 0:
                updates.append(self.train(mb, self.loss, denominator))
        return role_figures("critic", updates) | {
            "critic/skipped_nonfinite": sum(u["skipped_nonfinite"] for u in updates),  # a count, not a mean
            "timing/critic_train_s": time.perf_counter() - t0}


class Models:
    """The policy and, as the run needs them, the critic, the reference policy and the reward model."""

    def __init__(self, cfg: RunConfig, place: Placement, model_path: str):
        spec = settings.model_spec(cfg, model_path)
        self.cfg = cfg
        self.policy = PolicyGroup(cfg, place, "policy", spec, cfg.run.seed)
        self.critic = CriticGroup(cfg, place, spec, cfg.run.seed + 1) if cfg.critic_enabled else None
        self.reference = PolicyGroup(cfg, place, "reference", spec, cfg.run.seed + 2) if cfg.uses_reference else None
        self.reward_model = None
        if cfg.reward_model.path:  # scores only: like a critic (value head from its score.weight), routing freely
            rm = cfg.reward_model.path
            self.reward_model = TrainerGroup(cfg, place, "reward_model", dataclasses.replace(
                settings.model_spec(cfg, rm), routing_replay=False), "critic", settings.optim_settings(cfg, cfg.critic.lr),
                cfg.run.seed + 3, value_head_from=rm, trains=False)

    def started(self) -> None:
        """Wait for every group's ranks (they start side by side, and beside the engines unless those
        start first: cluster.engines_first)."""
        for group in self.groups().values():
            group.started()

    def groups(self) -> dict[str, TrainerGroup]:
        return {k: g for k, g in {"policy": self.policy, "critic": self.critic, "reference": self.reference,
                                  "reward_model": self.reward_model}.items() if g}

    def score(self, batch: Batch, diagnostics: bool) -> Scores:
        """Forward passes over `batch`, each data-parallel replica on its shard: the policy (unless the
        step's one update gives pi_old: RunConfig.proximal_from_update) and the reference with the
        rollout's routes replayed, the critic and the reward model routing freely (the reward model's
        value at each episode's last position is its score). With `diagnostics` (and routes to replay)
        the policy also routes freely once, to measure what replay removes."""
        scores = Scores(None if self.cfg.proximal_from_update else self.policy.score(batch.model_inputs())["logp"])
        if diagnostics and batch.routes_BSLK is not None:
            free = self.policy.score(batch.model_inputs(routes=False), record_routes=True)
            scores.free_logp_BS, scores.free_routes_BSLK = free["logp"], free["routes"]
        if self.reference:
            scores.logp_ref_BS = self.reference.score(batch.model_inputs())["logp"]
        if self.critic:
            scores.critic_out_BS = self.critic.score(batch.model_inputs(routes=False))["values"]
        if self.reward_model:  # each episode at its last token
            values = self.reward_model.score(batch.model_inputs(routes=False))["values"]
            scores.reward_model_B = boundary_values(values, batch.lengths_B)  # the output at position length - 1
        return scores

    def fit(self, batch: Batch, t: Targets, step: int) -> tuple[dict[str, float], torch.Tensor | None]:
        """The critic's update, then (past critic.warmup_steps) the policy's; their figures and the
        policy's log-probs before the update when its forward gave them (PolicyGroup.fit). Timings and
        the policy's skip counts are figures of every step (0 for a model that did not train); the
        learning rates, of the steps that trained."""
        t0 = time.perf_counter()
        out = {"timing/critic_train_s": 0.0, "timing/actor_train_s": 0.0, "policy/skipped_minibatches": 0,
               "policy/skipped_nonfinite": 0}
        out |= self.critic.fit(batch, t, step) if self.critic else {}
        logp = None
        if step >= self.cfg.critic.warmup_steps:
            figures, logp = self.policy.fit(batch, t, step)
            out |= figures
        for role in ("reference", "reward_model"):  # they only score: their memory is asked for (the others
            if getattr(self, role):                 # report theirs with each update)
                out |= role_figures(role, getattr(self, role).call("memory"))
        tokens = float(batch.lengths_B.sum()) * self.cfg.trainer.epochs
        out["perf/train_tokens_per_s"] = tokens / max(time.perf_counter() - t0, 1e-9)
        return out, logp

    def offload(self) -> dict[str, float]:
        """Colocated with cluster.offload: every trainer rank hands its device memory (parameters,
        gradient buffers, optimizer state) to the engines until `onload`; restored bitwise."""
        if not self.cfg.cluster.offload:
            return {}
        moved = sum(sum(group.call("offload")) for group in self.groups().values())
        return {"memory/offloaded_gib": moved / 2**30}

    def onload(self) -> None:
        if self.cfg.cluster.offload:
            for group in self.groups().values():
                group.call("onload")

    def route_figures(self) -> dict[str, float]:
        """Bytes of routes each policy rank received since the last call, for scoring and in all, and
        what the path before 2026-12 sent for the same calls (int64 routes; scoring sent every rank the
        whole batch, training already its shard): the benchmark's baseline."""
        g, out = self.policy, {}
        for kind, prefix in (("score", "routing/score_"), (None, "routing/")):
            sent = sum(v["sent"] for k, v in g.route_bytes.items() if kind in (None, k))
            old = sum(v["int64_computed"] for k, v in g.route_bytes.items() if kind in (None, k))
            out |= {f"{prefix}route_bytes_per_rank": sent / g.world, f"{prefix}route_bytes_per_rank_int64_computed": old / g.world}
        for group in self.groups().values():
            group.route_bytes = group.new_route_counters()
        return out

