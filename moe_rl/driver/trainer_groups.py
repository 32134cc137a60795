"""The models a step trains and scores with: the policy, the critic, the reference, the reward model and
the distillation teachers, each a group of Megatron ranks (trainer_groups.TrainerGroup), and the update
loops they own.

    models = Models(cfg, place, model_path)
    scores = models.score(batch, diagnostics)       # DP-sharded forward passes, routes replayed
    figures, logp = fit(models, batch, targets, step)  # the critic, then the policy (driver/updates.py)
"""

from __future__ import annotations

import time

import torch

from moe_rl.algos.targets import Scores, TargetSpec, boundary_values
from moe_rl.batch import Batch
from moe_rl.config import RunConfig
from moe_rl.driver.placement import Placement
from moe_rl.driver.rank_actor import RankActor
from moe_rl.driver.remote import gather
from moe_rl.driver.specs import GroupSpec, RunSpecs
from moe_rl.metrics import reduce_updates
from moe_rl.plan import hf_config_of
from moe_rl.train.lr_schedule import lr_at
from moe_rl.train.objectives import PolicyLoss, SftLoss, ValueLoss
from moe_rl.train.results import ScoreResult, UpdateResult


class TrainerGroup:
    """The ranks of one model (policy, critic, reference, reward model or a distillation teacher): batches
    go out sharded by data-parallel replica, results come back merged. PolicyGroup and CriticGroup add each
    model's update loop.

    Its actors start in the background (beside the other groups' and the engines'): `started` waits."""

    def __init__(self, cfg: RunConfig, place: Placement, slot: str, spec: GroupSpec, par=None):
        """`spec`: what its ranks are built from (driver.specs.group_specs); `par`: the group's layout (a
        ParallelSection over parallel.world_size ranks; default cfg.parallel)."""
        from moe_rl.train.parallel import Layout

        par = par or cfg.parallel
        layout = Layout(tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp, etp=par.etp)
        world = par.world_size
        addr, port = place.address(slot)
        self.actors = [RankActor.options(**place.options(slot, r)).remote(
            r, world, addr, port, spec.model, spec.role, spec.optim, spec.seed, layout,
            place.threads_of(slot, r), value_head_from=spec.value_head_from, trains=spec.trains)
            for r in range(world)]
        self.dp = par.dp
        self.world = world
        self.tp_cp = par.tp * par.cp
        self.slot, self.timeout_s = slot, cfg.cluster.call_timeout_s
        self.start_timeout_s = cfg.cluster.start_timeout_s  # for the ranks' start (started)
        # data-parallel shards by estimated compute (train.parallel.row_cost: attention_span = 6 h)
        self.balance = cfg.trainer.dp_balance
        self.attention_span = 6.0 * hf_config_of(cfg, spec.model.hf_path)["hidden_size"]
        self.imbalance: dict[str, list[float]] = {"estimated": [], "measured": []}
        self._placed = [a.placed.remote() for a in self.actors]  # answered once each rank has built its model
        self.nodes: list[str] = []
        self.threads: list[int] = []  # each rank's CPU threads
        self.route_bytes = self.new_route_counters()

    def started(self) -> None:
        """Wait until every rank has started (its model built and loaded)."""
        started = self._gather("start", self._placed, start=True)
        self.nodes, self.threads = map(list, zip(*started, strict=True))

    def export_weights(self, bucket_mb: float, adapters: bool = False) -> list:
        """Refs to the whole model's weight buckets in Ray's object store, put there by the ranks (adapters:
        the LoRA adapters alone, in PEFT's names)."""
        return [ref for refs in self.call("export_weights", bucket_mb, adapters) for ref in refs]

    def start_transfer(self, backend: str, engines: list, workers_per_engine: list[int],
                       bucket_mb: float) -> None:
        """Open vLLM's weight transfer (nccl | ipc) between this group's rank 0 and every engine worker
        (bucket_mb: rollout.weight_sync_bucket_mb)."""
        from moe_rl.rollout.transfer import engine_rank_offsets

        world = 1 + sum(workers_per_engine)
        self.call("start_transfer", backend, engines, world, engine_rank_offsets(workers_per_engine),
                  bucket_mb)

    def send_weights(self, version: int) -> None:
        """One sync round: rank 0 sends while the others take part in the export."""
        self.call("send_weights", version)

    def _dp_rank(self, rank: int) -> int:
        from moe_rl.train.parallel import dp_rank_of

        return dp_rank_of(rank, tp=self.tp_cp, cp=1, dp=self.dp)  # only tp*cp matters to the order

    def _cost(self, batch) -> torch.Tensor:
        """Each row's estimated compute, [B] (train.parallel.row_cost)."""
        from moe_rl.train.parallel import row_cost

        return row_cost(batch.lengths_B, self.attention_span)

    def _parts(self, cost_B: torch.Tensor) -> list[torch.Tensor]:
        """The rows of each data-parallel replica (train.parallel.dp_partition, trainer.dp_balance)."""
        from moe_rl.train.parallel import dp_partition

        return dp_partition(cost_B, self.dp, self.balance)

    def _shard(self, batch, rank: int, parts: list[torch.Tensor] | None = None):
        """Each DP replica gets its rows; TP/PP ranks of one replica get the same rows."""
        if self.dp == 1:
            return batch
        return batch.rows((parts or self._parts(self._cost(batch)))[self._dp_rank(rank)])

    @staticmethod
    def new_route_counters() -> dict[str, dict[str, int]]:
        """Bytes of routes sent to the ranks per call kind: as sent (each rank its shard, in the routes'
        compact dtype; measured) and, computed rather than measured, what the path before 2026-12 would
        have sent (8 bytes x elements, int64; scoring sent the whole batch to every rank)."""
        return {kind: {"sent": 0, "int64_computed": 0} for kind in ("score", "train")}

    def _send(self, batch, kind: str) -> tuple[list, list[torch.Tensor]]:
        """This batch's shard for each rank, counting the route bytes it carries, and the rows of each
        replica (for `_whole`)."""
        from moe_rl.train.parallel import imbalance

        cost = self._cost(batch)
        parts = self._parts(cost)
        shards = [self._shard(batch, r, parts) for r in range(self.world)]
        if self.dp > 1:
            self.imbalance["estimated"].append(imbalance(cost, parts))
        if batch.routes_BSLK is not None:
            count = self.route_bytes[kind]
            count["sent"] += sum(s.routes_BSLK.nbytes for s in shards)
            # computed, not measured: the int64 bytes the old path would have sent for the same routes
            count["int64_computed"] += 8 * sum((batch if kind == "score" else s).routes_BSLK.numel()
                                               for s in shards)
        return shards, parts

    def score(self, batch, **kw) -> ScoreResult:
        """Forward passes, each data-parallel replica on its rows; results for the whole batch,
        [B, S, ...]."""
        shards, parts = self._send(batch, "score")
        outs = self._gather("score", [a.score.remote(s, **kw)
                                      for a, s in zip(self.actors, shards, strict=True)])
        if self.dp > 1:  # each replica's slowest rank (replicas do not wait for each other while scoring)
            per_replica = [0.0] * self.dp
            for rank, out in enumerate(outs):
                d = self._dp_rank(rank)
                per_replica[d] = max(per_replica[d], out.seconds)
            self.imbalance["measured"].append(max(per_replica) / max(sum(per_replica) / self.dp, 1e-9))
        return self._whole(batch, outs, parts)

    def _whole(self, batch, outs: list[ScoreResult], parts: list[torch.Tensor]) -> ScoreResult:
        """The ranks' per-shard outputs ([b, s, ...] each) as the whole batch's, [B, S, ...]; `parts`: the
        rows each replica was sent."""
        if self.dp == 1:
            return outs[0]
        (B, S), full = batch.input_ids_BS.shape, {}
        for rank in range(0, self.tp_cp * self.dp, self.tp_cp):  # one rank per replica (its ranks all agree)
            rows = parts[self._dp_rank(rank)]
            for name, x in outs[rank].tensors().items():
                full.setdefault(name, torch.zeros((B, S, *x.shape[2:]), dtype=x.dtype))[rows, :x.shape[1]] = x
        return ScoreResult(**full)

    def train(self, batch, loss, denominator, keep_logp: bool = False) -> UpdateResult:
        """One update with `loss` (a train.objectives type): each rank gets its shard of the fields the
        loss reads. The ranks' figures merged; keep_logp: logp_BS, the update's forward before the step,
        [B, S]."""
        shards, parts = self._send(batch.only(loss.fields), "train")
        outs = self._gather("train", [a.train.remote(s, loss, denominator, keep_logp)
                                      for a, s in zip(self.actors, shards, strict=True)])
        logp = None
        if keep_logp:
            logp = self._whole(batch, [ScoreResult(logp_BS=o.logp_BS) for o in outs], parts).logp_BS
        # last-stage ranks: tp*cp per replica
        losses = [o.figures["loss"] for o in outs if "loss" in o.figures]
        # over the shards: means, maxima of *max, minima of *min
        merged = reduce_updates([o.figures for o in outs])
        if losses:
            merged["loss"] = sum(losses) / self.tp_cp  # each replica's share of the global loss, summed
        return UpdateResult(merged, logp)

    def call(self, method: str, *args):
        return self._gather(method, [getattr(a, method).remote(*args) for a in self.actors])

    def _gather(self, method: str, refs: list, start: bool = False) -> list:
        calls = [(f"{self.slot} rank {r} ({method})", ref) for r, ref in enumerate(refs)]
        if start:
            return gather(calls, self.start_timeout_s, setting="cluster.start_timeout_s")
        return gather(calls, self.timeout_s)



class PolicyGroup(TrainerGroup):
    def __init__(self, cfg: RunConfig, place: Placement, slot: str, spec: GroupSpec, loss: PolicyLoss,
                 params: TargetSpec):
        super().__init__(cfg, place, slot, spec)
        self.cfg, self.loss, self.params = cfg, loss, params
        self.lr = cfg.trainer.lr  # the optimizer's learning rate now

    def set_lr(self, lr: float) -> None:
        if lr != self.lr:
            self.call("set_lr", lr)
            self.lr = lr

    def scheduled_lr(self, step: int) -> float:
        """trainer.lr_schedule's learning rate of RL step `step` (train.lr_schedule.lr_at)."""
        tr = self.cfg.trainer
        return lr_at(step, tr.lr, tr.lr_schedule, tr.lr_warmup_steps, self.cfg.lr_decay_end, tr.lr_min)

    def warm_start(self, batches: list[Batch], lr: float) -> dict[str, float]:
        """Supervised steps on demonstration batches at learning rate `lr`; their figures (warm_start/:
        the first and last NLL, the steps, the learning rate the optimizer used)."""
        from tqdm import tqdm

        self.set_lr(lr)
        updates = [self.train(b, SftLoss(), b.mask_BS.sum().double())
                   for b in tqdm(batches, desc="warm start", unit="step",
                                 disable=not self.cfg.logging.progress_bar, leave=False)]
        nll = [u.figures.get("nll", float("nan")) for u in updates]
        return {"warm_start/nll_first": nll[0], "warm_start/nll_last": nll[-1], "warm_start/steps": len(nll),
                "warm_start/lr": updates[-1].figures["lr"]}

    def init_anchor(self) -> None:
        """theta_bar_0 := theta_0 (PPO-EWMA), when the algorithm anchors to an EWMA of the policy."""
        if self.params.ewma_anchor:
            self.call("init_anchor", self.cfg.algorithm.ewma_decay)


class CriticGroup(TrainerGroup):
    def __init__(self, cfg: RunConfig, place: Placement, spec: GroupSpec, loss: ValueLoss):
        super().__init__(cfg, place, "critic", spec)
        self.cfg, self.path, self.loss = cfg, spec.model.hf_path, loss

class Models:
    """The policy and, as the run needs them, the critic, the reference policy, the reward model and the
    distillation teachers."""

    def __init__(self, cfg: RunConfig, place: Placement, run: RunSpecs):
        """Each group of `run.groups` (driver.specs.group_specs says who needs which), started in order."""
        g = run.groups
        self.cfg = cfg
        self.policy = PolicyGroup(cfg, place, "policy", g["policy"], run.policy_loss, run.targets)
        self.critic = CriticGroup(cfg, place, g["critic"], run.value_loss) if "critic" in g else None
        self.reference = PolicyGroup(cfg, place, "reference", g["reference"], run.policy_loss, run.targets) \
            if "reference" in g else None
        # scores only: like a critic (value head from its score.weight)
        self.reward_model = TrainerGroup(cfg, place, "reward_model", g["reward_model"]) \
            if "reward_model" in g else None
        self.teachers = {slot: TrainerGroup(cfg, place, slot, g[slot], par=cfg.teacher_parallel)
                         for slot in cfg.teachers}

    def started(self) -> None:
        """Wait for every group's ranks (they start side by side, and beside the engines unless those
        start first: placement.engines_first)."""
        for group in self.groups().values():
            group.started()

    def groups(self) -> dict[str, TrainerGroup]:
        return {k: g for k, g in {"policy": self.policy, "critic": self.critic, "reference": self.reference,
                                  "reward_model": self.reward_model, **self.teachers}.items() if g}

    def score(self, batch: Batch, diagnostics: bool) -> Scores:
        """Forward passes over `batch`, each data-parallel replica on its shard: the policy (unless the
        step's one update gives pi_old: RunConfig.proximal_from_update) and the reference with the
        rollout's routes replayed, the critic and the reward model routing freely (the reward model's
        value at each episode's last position is its score). With `diagnostics` (and routes to replay)
        the policy also routes freely once, to measure what replay removes."""
        scores = Scores(None if self.cfg.proximal_from_update
                        else self.policy.score(batch.model_inputs()).logp_BS)
        if diagnostics and batch.routes_BSLK is not None:
            free = self.policy.score(batch.model_inputs(routes=False), record_routes=True)
            scores.free_logp_BS, scores.free_routes_BSLK = free.logp_BS, free.routes_BSLK
        if self.cfg.uses_reference:
            scores.logp_ref_BS = (self.reference.score(batch.model_inputs()) if self.reference
                                  else self.policy.score(batch.model_inputs(), adapters=False)).logp_BS
        if self.critic:
            scores.critic_out_BS = self.critic.score(batch.model_inputs(routes=False)).critic_out_BS
        if self.teachers:
            scores.logp_teacher_BS, scores.teacher_seconds = self.score_teachers(batch)
        if self.reward_model:  # each episode at its last token
            values = self.reward_model.score(batch.model_inputs(routes=False)).critic_out_BS
            # the output at position length - 1
            scores.reward_model_B = boundary_values(values, batch.lengths_B)
        return scores

    def score_teachers(self, batch: Batch) -> tuple[torch.Tensor, float]:
        """Each row's log-probs under its teacher (batch.teacher_B; routing freely), [B, S], and the
        seconds the teachers took. A teacher scores only its rows (all rows when they are fewer than its
        data-parallel replicas)."""
        t0 = time.perf_counter()
        inputs = batch.model_inputs(routes=False)
        out = torch.zeros(batch.input_ids_BS.shape)
        for i, group in enumerate(self.teachers.values()):
            rows = (batch.teacher_B == i).nonzero().squeeze(1)
            if len(rows) == batch.size or 0 < len(rows) < group.dp:
                out[rows] = group.score(inputs).logp_BS[rows]
            elif len(rows):
                logp = group.score(inputs.rows(rows)).logp_BS
                out[rows, :logp.shape[1]] = logp
        return out, time.perf_counter() - t0

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

    def balance_figures(self) -> dict[str, float]:
        """How evenly the policy's data-parallel shards shared the work since the last call (steps with
        parallel.dp > 1): timing/dp_imbalance, max / mean of the replicas' estimated cost per call
        (train.parallel.row_cost), averaged over the calls; timing/dp_imbalance_measured, max / mean of the
        replicas' wall time of the scoring passes (forward only: with expert parallelism the replicas
        meet in its all-to-alls, which hides the imbalance)."""
        got = self.policy.imbalance
        self.policy.imbalance = {"estimated": [], "measured": []}
        return {f"timing/dp_imbalance{'' if k == 'estimated' else '_measured'}": sum(v) / len(v)
                for k, v in got.items() if v}

    def route_figures(self) -> dict[str, float]:
        """Bytes of routes each policy rank received since the last call, for scoring and in all, and
        what the path before 2026-12 sent for the same calls (int64 routes; scoring sent every rank the
        whole batch, training already its shard): the benchmark's baseline."""
        g, out = self.policy, {}
        for kind, prefix in (("score", "routing/score_"), (None, "routing/")):
            sent = sum(v["sent"] for k, v in g.route_bytes.items() if kind in (None, k))
            old = sum(v["int64_computed"] for k, v in g.route_bytes.items() if kind in (None, k))
            out |= {f"{prefix}route_bytes_per_rank": sent / g.world,
                    f"{prefix}route_bytes_per_rank_int64_computed": old / g.world}
        for group in self.groups().values():
            group.route_bytes = group.new_route_counters()
        return out

