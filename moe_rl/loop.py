"""The RL driver. One step:

    rollout -> rewards -> old / reference log-probs and values (routes replayed) -> advantages
    -> critic update -> actor update (epochs x minibatches) -> weight sync -> metrics -> checkpoint

Synchronous mode does these in order. Asynchronous mode starts the next rollout before training on
the current batch (the engine keeps generating while the trainer trains), syncs weights into the
running engine between its steps, and drops samples older than `rollout.max_staleness` versions.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import ray
import torch

from moe_rl import batch as batching
from moe_rl.algos import aggregate, checks, correction, registry, stats
from moe_rl.algos import rewards as R
from moe_rl.algos.advantages import AdvantageInputs, AdvantageParams, whiten
from moe_rl.config import RunConfig
from moe_rl.metrics import Metrics, reduce_updates
from moe_rl.types import Outcome
from moe_rl.weights.hf import HF_CONFIG_DIR, copy_hf_config


def main(cfg: RunConfig) -> int:
    return Trainer(cfg).run()


def say(msg: str) -> None:
    print(f"[moe-rl] {msg}", flush=True)


def step_targets(b, values, boundary, logp_ref, alg, token_budget: int):
    """Advantages [B, S], returns [B, S] (None without a critic) and reward metrics for batch `b`.

    Rewards are shaped first, by the KL penalty (u_t - beta k_t) and the DAPO overlong penalty R_len on
    the last model token, where the length is the episode's tokens after the prompt (model and
    observation tokens: the unit environment.token_budget bounds). Both act on the per-token rewards
    u_t (GAE, reward-to-go) and, through R(tau) = sum_t u_t, on the score the outcome estimators read
    (GRPO, RLOO, REINFORCE, ...): R(tau) - beta sum_t k_t + R_len. So every estimator sees them.
    """
    rewards, m = b.rewards, {}
    if alg.kl_reward_coef:
        rewards, k = R.kl_shaped_rewards(rewards, b.logp_mu, logp_ref, b.mask, alg.kl_reward_coef, alg.kl_reward_estimator)
        m["reward/kl_penalty_mean"] = (k * b.mask).sum() / b.mask.sum().clamp(min=1)
    if alg.overlong_buffer:
        penalty = R.overlong_penalty(b.lengths - b.prompt_len, token_budget, alg.overlong_buffer, alg.overlong_penalty)
        rewards = rewards + R.place_terminal_reward(penalty, b.mask)
        m["reward/overlong_penalty_mean"] = penalty.mean()
    score = rewards.sum(1) if (alg.kl_reward_coef or alg.overlong_buffer) else b.score
    inp = AdvantageInputs(rewards_BT=rewards, mask_BT=b.mask, score_B=score, group_B=b.group,
                          values_BT=values, terminated_B=b.terminated, boundary_value_B=boundary)
    hp = AdvantageParams(gamma=alg.gamma, lam=alg.lam, lam_critic=alg.lam_critic,
                         length_adaptive_alpha=alg.length_adaptive_alpha)
    adv, returns = registry.get("advantage", alg.advantage)(inp, hp)
    if alg.whiten_advantages:
        adv = whiten(adv, b.mask)
    return adv.float(), returns, m


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.out = Path(cfg.run.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.run.seed)

    # -- setup ------------------------------------------------------------------------------------

    def _model_path(self) -> str:
        cfg = self.cfg
        if cfg.model.path:
            return cfg.model.path
        from moe_rl.tiny import build_tiny_checkpoint

        return str(build_tiny_checkpoint(self.out / "base_model", cfg.model.tiny, seed=cfg.run.seed))

    def _setup(self) -> None:
        from moe_rl import cluster
        from moe_rl.rollout.agent import AgentSettings
        from moe_rl.rollout.engine import EngineSettings
        from moe_rl.rollout.envs import get_env
        from moe_rl.train.model import ModelSpec
        from moe_rl.train.worker import OptimSettings

        cfg = self.cfg
        path = self._model_path()
        say(f"starting Ray, {cfg.parallel.world_size} policy rank(s){' + critic' if cfg.critic_enabled else ''} and a vLLM engine")
        cluster.start_ray(cfg)
        spec = ModelSpec(hf_path=path, dtype=cfg.model.dtype, layer_spec=cfg.model.layer_spec, fp8=cfg.model.fp8,
                         recompute=cfg.model.recompute, moe_dispatcher=cfg.model.moe_dispatcher,
                         routing_replay=cfg.rollout.record_routes)
        tr = cfg.trainer
        optim = OptimSettings(lr=tr.lr, weight_decay=tr.weight_decay, adam_beta1=tr.adam_beta1, adam_beta2=tr.adam_beta2,
                              grad_clip=tr.grad_clip, distributed_optimizer=cfg.parallel.distributed_optimizer,
                              micro_batch_tokens=tr.micro_batch_tokens, pack_sequences=tr.pack_sequences)
        use_reference = bool(cfg.algorithm.kl_loss_coef or cfg.algorithm.kl_reward_coef)
        n = cfg.parallel.world_size
        place = cluster.Placement(cfg, {"policy": n, "critic": n if cfg.critic_enabled else 0,
                                        "reference": n if use_reference else 0, "engine": cfg.rollout.num_engines})
        self.policy = cluster.TrainerGroup(cfg, place, "policy", spec, "policy", optim, cfg.run.seed)
        self.critic = None
        if cfg.critic_enabled:
            copt = OptimSettings(**{**optim.__dict__, "lr": cfg.critic.lr})
            # critic.init_from: the policy's checkpoint, or another one (a reward model: its score head
            # becomes the value head)
            source = None if cfg.critic.init_from == "policy" else cfg.critic.init_from
            # the critic routes freely: replaying the policy's rollout routes would force another
            # model's (possibly differently shaped) routers onto the policy's choices
            cspec = dataclasses.replace(spec, hf_path=source or spec.hf_path, routing_replay=False)
            self.critic_path = cspec.hf_path
            self.critic = cluster.TrainerGroup(cfg, place, "critic", cspec, "critic", copt, cfg.run.seed + 1,
                                               value_head_from=source)
        self.reference = None
        if use_reference:
            self.reference = cluster.TrainerGroup(cfg, place, "reference", spec, "policy", optim, cfg.run.seed + 2)
        env = cfg.environment
        self.env_cls = get_env(env.name)
        agent = AgentSettings(max_turns=env.max_turns, token_budget=env.token_budget, max_model_len=cfg.rollout.max_model_len,
                              max_tokens_per_turn=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                              top_p=cfg.rollout.top_p, overlong_filter=env.overlong_filter)
        self.transfer = cfg.rollout.weight_transfer
        self.engines = [cluster.RolloutActor.options(**place.options("engine", i)).remote(
            EngineSettings(path, dtype=cfg.model.dtype, max_model_len=cfg.rollout.max_model_len, seed=cfg.run.seed,
                           record_routes=cfg.rollout.record_routes, kv_cache_gb=cfg.rollout.kv_cache_gb,
                           route_source=cfg.rollout.route_source, weight_transfer=self.transfer),
            agent, env.name, {**env.options, "tool_timeout_s": env.tool_timeout_s}) for i in range(cfg.rollout.num_engines)]
        self.rollout = self.engines[0]  # evaluation and settings
        infos = ray.get([e.info.remote() for e in self.engines])
        self.top_k = infos[0]["top_k"]
        self.engine_nodes = [i["node"] for i in infos]
        groups = {"policy": self.policy, "critic": self.critic, "reference": self.reference}
        say("placement: " + "; ".join([f"{k} ranks on {', '.join(g.nodes)}" for k, g in groups.items() if g]
                                      + [f"engines on {', '.join(self.engine_nodes)}"]))
        if self.transfer != "files":
            self.policy.start_transfer(self.transfer, self.engines, [i["workers"] for i in infos])
        say(f"weight sync: {self.transfer}")
        self.model_path = path
        self.version = 0
        self.step = 0
        self.data_pos = 0
        self.prompts = self._load_prompts()

    def _load_prompts(self) -> list[dict]:
        env = self.cfg.environment
        if env.dataset:
            from moe_rl.rollout.data import load_prompts

            return load_prompts(env.dataset)
        return self.env_cls.generate_prompts(100_000, seed=self.cfg.run.seed, **env.options)

    def _next_prompts(self) -> list[dict]:
        n = self.cfg.rollout.prompts_per_step * (1 + (self.cfg.environment.max_resample_rounds if self.cfg.environment.dynamic_sampling else 0))
        out = [self.prompts[(self.data_pos + i) % len(self.prompts)] for i in range(n)]
        self.data_pos += n
        return out

    # -- one step -----------------------------------------------------------------------------------

    def _collect(self, seed: int):
        """Split this step's prompts over the engines; returns their pending results."""
        env = self.cfg.environment
        prompts = self._next_prompts()
        k = len(self.engines)
        bounds = [len(prompts) * i // k for i in range(k + 1)]
        return [e.collect.remote(prompts[bounds[i]:bounds[i + 1]], self.cfg.rollout.samples_per_prompt, seed,
                                 env.max_resample_rounds if env.dynamic_sampling else 0, bounds[i])
                for i, e in enumerate(self.engines) if bounds[i + 1] > bounds[i]]

    @staticmethod
    def _gather(pending):
        """Merge the engines' trajectories and rollout statistics."""
        from moe_rl.rollout.agent import RolloutStats

        trajs, stats = [], RolloutStats()
        for t, st in ray.get(pending):
            trajs.extend(t)
            stats.outcomes.update(st.outcomes)
            stats.rejected.update(st.rejected)
            stats.dropped_groups += st.dropped_groups
            stats.overlong_filtered += st.overlong_filtered
            stats.tool_errors += st.tool_errors
        return trajs, stats

    def _token_batch(self, b, replay: bool = True, **tensors):
        """Batch `b` for a trainer group; with `replay` (the policy's groups) the rollout's routes ride along."""
        from moe_rl.train.worker import TokenBatch

        return TokenBatch(b.input_ids, b.lengths, b.routes if replay and self.cfg.rollout.record_routes else None, tensors)

    def _correct(self, logp_old, b):
        alg = self.cfg.algorithm
        return registry.get("correction", alg.correction)(logp_old, b.logp_mu, b.mask, correction.CorrectionParams(
            alg.is_cap, alg.seq_is_cap, alg.icepop_min, alg.icepop_max))

    def _train_step(self, trajs, rstats) -> dict:
        cfg, alg = self.cfg, self.cfg.algorithm
        t0 = time.perf_counter()
        timings = {}
        b = batching.build_batch(trajs, self.top_k if cfg.rollout.record_routes else None)
        keep, stale = correction.staleness(b.version, self.version, cfg.rollout.max_staleness if cfg.rollout.async_mode else None)
        if not bool(keep.all()):
            b = b.select(keep.nonzero().squeeze(1))
        ewma = alg.anchor == "ewma"
        # --- old / reference log-probs and values, routes replayed
        t = time.perf_counter()
        plain = self._token_batch(b)
        logp_replay = self.policy.score(plain)["logp"]
        # pi_old: mu itself (bypass), the EWMA anchor (scored per minibatch, below: it moves after each
        # update), or the policy before this step's updates
        logp_old = b.logp_mu if alg.correction == "bypass" else None if ewma else logp_replay
        # the trainer's own routing (no replay): the mismatch R3 removes, and the routing agreement
        free = self.policy.score(self._token_batch(b, replay=False), record_routes=b.routes is not None)
        logp_ref = self.reference.score(plain)["logp"] if self.reference else None
        values = boundary = None
        if self.critic:
            values, boundary = batching.state_values(self.critic.score(self._token_batch(b, replay=False))["values"],
                                                     b.boundary_len)
        timings["timing/score_s"] = time.perf_counter() - t
        # --- the pre-update checklist, before any target is computed
        corr = None if ewma else self._correct(logp_old, b)  # EWMA: per minibatch (config: ewma reads mu)
        reads_mu = ewma or corr.needs_behaviour
        checks.check_batch(b.mask, torch.arange(b.input_ids.shape[1]).expand_as(b.mask) < b.lengths.unsqueeze(1), b.rewards,
                           b.terminated, boundary, b.logp_mu, logp_old, logp_ref, needs_behaviour=reads_mu,
                           needs_reference=bool(alg.kl_loss_coef or alg.kl_reward_coef), needs_boundary=self.critic is not None,
                           # synchronous PPO without a correction assumes mu = pi_old: verify it
                           synchronous=not cfg.rollout.async_mode and not reads_mu and not ewma)
        # --- advantages and returns (pure math)
        t = time.perf_counter()
        adv, returns, out = step_targets(b, values, boundary, logp_ref, alg, cfg.environment.token_budget)
        timings["timing/advantages_s"] = time.perf_counter() - t
        # --- critic update
        t = time.perf_counter()
        critic_updates = []
        if self.critic:
            for _ in range(cfg.trainer.epochs):
                for rows in self._minibatches(b.size):
                    mb = self._token_batch(b.select(rows), replay=False, mask=b.mask[rows], returns=returns[rows].float(),
                                           values_old=values[rows].float())
                    denom = aggregate.loss_denominator(b.mask[rows], "token_mean")
                    if float(denom) > 0:
                        critic_updates.append(self.critic.train(mb, ("value", cfg.critic.value_clip), denom))
        timings["timing/critic_train_s"] = time.perf_counter() - t
        # --- actor update
        t = time.perf_counter()
        policy_updates, corr_updates, skipped, anchor_gap = [], [], 0, None
        if self.step >= cfg.critic.warmup_steps:
            from moe_rl.train.actor import PolicyLossSpec

            spec = PolicyLossSpec(alg.policy_loss, alg.clip_low, alg.clip_high, alg.dual_clip, alg.aggregation,
                                  alg.kl_loss_coef, alg.kl_loss_estimator, alg.entropy_coef)
            constant = alg.loss_constant or float(cfg.environment.token_budget)
            for _ in range(cfg.trainer.epochs):
                for rows in self._minibatches(b.size):
                    mb = b.select(rows)
                    if ewma:  # update n uses pi_{theta_bar_{n-1}}, the anchor as it is now
                        old_rows = self.policy.score(self._token_batch(mb), anchor=True)["logp"]
                        mb_corr = self._correct(old_rows, mb)
                        corr_updates.append(mb_corr.metrics)
                        if anchor_gap is None:  # the anchor vs the policy at the start of the step
                            anchor_gap = ((old_rows - logp_replay[rows]).abs() * mb.mask).sum() / mb.mask.sum().clamp(min=1)
                    else:
                        old_rows, mb_corr = logp_old[rows], correction.Correction(corr.weight_BT[rows], corr.keep_BT[rows])
                    lm = mb.loss_mask & mb_corr.keep_BT  # the policy-gradient term: tokens the correction keeps
                    w = mb_corr.weight_BT.float()
                    denoms = {"policy": aggregate.loss_denominator(lm, alg.aggregation, constant, w, alg.self_normalize),
                              "regularizer": aggregate.loss_denominator(mb.loss_mask, alg.aggregation, constant)}
                    if not float(denoms["policy"]) > 0:  # nothing kept (or NaN): a skip, never an epsilon
                        skipped += 1
                        continue
                    tensors = dict(loss_mask=lm, reg_mask=mb.loss_mask, adv=adv[rows], logp_old=old_rows.float(), is_weight=w)
                    if logp_ref is not None:
                        tensors["logp_ref"] = logp_ref[rows]
                    policy_updates.append(self.policy.train(self._token_batch(mb, **tensors), ("policy", spec), denoms))
        timings["timing/actor_train_s"] = time.perf_counter() - t
        # --- weight sync
        t = time.perf_counter()
        self.version += 1
        self._sync()
        timings["timing/sync_s"] = time.perf_counter() - t
        # --- metrics: each figure over the whole step (every minibatch of every epoch)
        out.update({f"critic/{k}": v for k, v in reduce_updates(critic_updates).items()})
        out.update({f"policy/{k}": v for k, v in reduce_updates(policy_updates).items()})
        out.update({f"correction/{k}": v for k, v in (corr.metrics if corr else reduce_updates(corr_updates)).items()})
        valid = b.mask
        n_tok = valid.sum().clamp(min=1)
        out.update({
            "reward/mean": b.score.mean(), "reward/max": b.score.max(), "reward/min": b.score.min(),
            "reward/success_rate": (torch.tensor([t.terminal_reward for t in trajs]) > 0).float().mean(),
            "rollout/length_mean": b.lengths.float().mean(), "rollout/model_tokens_mean": valid.sum(1).float().mean(),
            "rollout/turns_mean": torch.tensor([len(t.spans) for t in trajs]).float().mean(),
            "rollout/samples": b.size, "rollout/rejected": sum(rstats.rejected.values()),
            "rollout/dropped_groups": rstats.dropped_groups, "rollout/tool_errors": rstats.tool_errors,
            "rollout/overlong_filtered": rstats.overlong_filtered,
            "policy/advantage_mean": (adv * valid).sum() / n_tok, "policy/skipped_minibatches": skipped,
            "policy/lr": cfg.trainer.lr, **({"critic/lr": cfg.critic.lr} if self.critic else {}),
            "correction/logp_mismatch_mean": ((logp_replay - b.logp_mu).abs() * valid).sum() / n_tok,
            "correction/logp_mismatch_max": ((logp_replay - b.logp_mu).abs() * valid).max(),
            "correction/logp_mismatch_no_replay": ((free["logp"] - b.logp_mu).abs() * valid).sum() / n_tok,
            "correction/staleness_mean": stale["staleness_mean"], "correction/staleness_max": stale["staleness_max"],
            "correction/stale_dropped": stale["stale_dropped"],
            "routing/filled_tail_positions_per_sample": b.routes_filled / max(1, b.size),
        })
        total = max(1, sum(rstats.outcomes.values()))
        for k in Outcome:  # every outcome every step (0 when absent): charts never join distant points
            out[f"rollout/outcome_{k.value}"] = rstats.outcomes.get(k.value, 0) / total
        for reason, n in rstats.rejected.items():
            out[f"rollout/rejected_{reason}"] = n
        if b.routes is not None and "routes" in free:
            # positions that influence a sampled token: everything before each sample's last model token
            last = R.last_action_index(b.mask)
            attn = torch.arange(b.input_ids.shape[1]).expand_as(valid) < last.unsqueeze(1)
            same = (free["routes"].sort(-1).values == b.routes.sort(-1).values).all(-1)  # [B, S, L]
            out["routing/agreement"] = (same & attn.unsqueeze(-1)).sum() / (attn.sum() * same.shape[-1]).clamp(min=1)
        if self.critic:
            out["critic/explained_variance"] = stats.explained_variance(values, returns, valid)
        step_s = time.perf_counter() - t0
        train_s = timings["timing/critic_train_s"] + timings["timing/actor_train_s"]
        out.update(timings)
        if anchor_gap is not None:
            out["policy/anchor_logp_gap"] = anchor_gap
        out["perf/train_tokens_per_s"] = float(b.lengths.sum()) * cfg.trainer.epochs / max(train_s, 1e-9)
        out["timing/train_step_s"] = step_s
        return out

    def _minibatches(self, n: int) -> list[torch.Tensor]:
        # every data-parallel rank gets at least one row of each minibatch
        k = max(1, min(self.cfg.trainer.minibatches, n // self.cfg.parallel.dp))
        g = torch.Generator().manual_seed(self.cfg.run.seed * 7919 + self.step)
        perm = torch.randperm(n, generator=g)
        return [perm[i::k] for i in range(k)]

    def _sync(self) -> None:
        from moe_rl.weights.sync import shm_dir

        if self.transfer != "files":  # vLLM's transfer from trainer rank 0 into every engine worker
            self.policy.send_weights(self.version)
            return
        d = str(shm_dir() / f"moe_rl_sync_{os.getpid()}_{self.version}")
        exported = self.policy.export_weights(d, self.cfg.rollout.weight_sync_bucket_mb)
        ray.get([e.update_weights.remote(self.policy.buckets_for(exported, node), self.version)
                 for e, node in zip(self.engines, self.engine_nodes, strict=True)])
        self.policy.drop_weights(d)

    # -- checkpoints --------------------------------------------------------------------------------

    def _init_anchor(self) -> None:
        if self.cfg.algorithm.anchor == "ewma":
            self.policy.call("init_anchor", self.cfg.algorithm.ewma_decay)

    def _ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    def save(self) -> Path:
        root = self._ckpt_root()
        final = root / f"step_{self.step:06d}"
        tmp = root / f".step_{self.step:06d}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        state = {"step": self.step, "version": self.version, "data_pos": self.data_pos}
        self.policy.call("save", str(tmp / "policy"), state)
        if self.critic:
            self.critic.call("save", str(tmp / "critic"), state)
        torch.save({**state, "torch_rng": torch.get_rng_state(), "py_rng": random.getstate(),
                    "np_rng": np.random.get_state()}, tmp / "loop_state.pt")
        sources = {"policy": self.model_path, **({"critic": self.critic_path} if self.critic else {})}
        for role, source in sources.items():
            copy_hf_config(source, tmp / role / HF_CONFIG_DIR)  # exportable with `moe-rl convert`
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # atomic: a crash before this line leaves the previous checkpoint as it was
        for old in sorted(root.glob("step_*"))[: -self.cfg.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _resume_dir(self) -> Path | None:
        r = self.cfg.checkpoint.resume
        if r == "never":
            return None
        if r != "auto":
            if not (Path(r) / "loop_state.pt").is_file():
                raise FileNotFoundError(f"checkpoint.resume: {r} is not a complete checkpoint")
            return Path(r)
        done = sorted(p for p in self._ckpt_root().glob("step_*") if (p / "loop_state.pt").is_file())
        return done[-1] if done else None

    def load(self, path: Path) -> None:
        self.policy.call("load", str(path / "policy"))
        if self.critic:
            self.critic.call("load", str(path / "critic"))
        st = torch.load(path / "loop_state.pt", weights_only=False)  # written by this program (RNG state tuples)
        self.step, self.version, self.data_pos = st["step"], st["version"], st["data_pos"]
        torch.set_rng_state(st["torch_rng"])
        random.setstate(st["py_rng"])
        np.random.set_state(st["np_rng"])
        self._sync()

    # -- warm start and evaluation -------------------------------------------------------------------

    def warm_start(self) -> dict:
        """Supervised warm start on scripted-expert episodes (see rollout/demos.py); returns metrics."""
        import asyncio

        from transformers import AutoTokenizer

        from moe_rl.rollout.agent import Agent
        from moe_rl.rollout.demos import ExpertPolicy
        from moe_rl.train.worker import TokenBatch

        cfg, tr = self.cfg, self.cfg.trainer
        tok = AutoTokenizer.from_pretrained(self.model_path)
        settings = ray.get(self.rollout.agent_settings.remote())
        agent = Agent(ExpertPolicy(tok, self.env_cls, cfg.run.seed), tok, self.env_cls,
                      {**cfg.environment.options}, settings)
        demo_prompts = self.env_cls.generate_prompts(tr.warm_start_steps * tr.warm_start_batch, seed=cfg.run.seed + 31337,
                                                     **cfg.environment.options)
        self.policy.call("set_lr", tr.warm_start_lr)
        say(f"supervised warm start: {tr.warm_start_steps} steps on scripted-expert episodes")
        nll = []
        for i in range(tr.warm_start_steps):
            prompts = demo_prompts[i * tr.warm_start_batch:(i + 1) * tr.warm_start_batch]
            trajs = [t for g in asyncio.run(agent.run_groups(prompts, 1)) for t in g]
            b = batching.build_batch(trajs, None)
            res = self.policy.train(TokenBatch(b.input_ids, b.lengths, None, {"loss_mask": b.mask}), ("sft", None),
                                    b.mask.sum().double())
            nll.append(res.get("nll", float("nan")))
        self.policy.call("set_lr", tr.lr)
        self._sync()
        return {"warm_start/nll_first": nll[0], "warm_start/nll_last": nll[-1], "warm_start/steps": len(nll)}

    def evaluate(self) -> dict:
        """Mean reward on held-out prompts (a seed the training prompts never use), one sample each."""
        env = self.cfg.environment
        say(f"evaluating on {self.cfg.trainer.eval_prompts} held-out prompts")
        prompts = self.env_cls.generate_prompts(self.cfg.trainer.eval_prompts, seed=self.cfg.run.seed + 424242, **env.options)
        trajs, _ = ray.get(self.rollout.collect.remote(prompts, 1, 99991, 0))
        scores = torch.tensor([t.total_reward for t in trajs])
        success = torch.tensor([float(t.terminal_reward > 0) for t in trajs])
        return {"eval/reward_mean": scores.mean(), "eval/success_rate": success.mean(), "eval/samples": len(trajs)}

    # -- the loop -----------------------------------------------------------------------------------

    def run(self) -> int:
        cfg = self.cfg
        self._setup()
        resume = self._resume_dir()
        summary = {}
        if resume is not None:
            self._init_anchor()  # its state comes back with the checkpoint
            self.load(resume)
            say(f"resumed from {resume} at step {self.step}")
            if self.step >= cfg.run.steps:
                say(f"this run already reached run.steps={cfg.run.steps}; raise run.steps to continue, or use a "
                    f"new run.output_dir (or checkpoint.resume=never) to start over")
        else:
            if cfg.trainer.warm_start_steps:
                summary.update(self.warm_start())
            self._init_anchor()  # RL starts here: theta_bar_0 = theta_0 (after any warm start)
        metrics = Metrics(self.out / "tensorboard" / cfg.run.name, cfg.logging.tensorboard, cfg.run.steps,
                          cfg.logging.progress_bar, self.step, every=cfg.logging.log_every)
        history = []
        if cfg.trainer.eval_prompts and resume is None:
            summary.update({f"{k}_before": float(v) for k, v in self.evaluate().items()})
        if summary:  # warm start and the evaluation before RL, at step 0
            metrics.log(0, {**self.evaluate_cached(summary), **{k: v for k, v in summary.items() if k.startswith("warm")}},
                        advance=False)
        try:
            pending = self._collect(cfg.run.seed * 1000 + self.step) if self.step < cfg.run.steps else None
            while self.step < cfg.run.steps:
                t0 = time.perf_counter()
                trajs, rstats = self._gather(pending)
                gen_s = time.perf_counter() - t0
                # async: the next rollout runs while this batch trains (bounded by max_staleness)
                nxt = self.step + 1
                pending = self._collect(cfg.run.seed * 1000 + nxt) if cfg.rollout.async_mode and nxt < cfg.run.steps else None
                if not trajs:
                    raise RuntimeError("no valid trajectories this step (see rollout/rejected); check the environment")
                out = self._train_step(trajs, rstats)
                out["timing/generate_wait_s"] = gen_s
                out["perf/generate_tokens_per_s"] = sum(sum(t.response_mask) for t in trajs) / max(gen_s, 1e-9)
                out["timing/step_s"] = time.perf_counter() - t0
                self.step += 1
                history.append(metrics.log(self.step, out))
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 or self.step == cfg.run.steps:
                    self.save()
                if pending is None and self.step < cfg.run.steps:
                    pending = self._collect(cfg.run.seed * 1000 + self.step)
            if cfg.trainer.eval_prompts:
                after = self.evaluate()
                summary.update({f"{k}_after": float(v) for k, v in after.items()})
                metrics.log(self.step, after, advance=False)
        finally:
            metrics.close()
        torch.save(history, self.out / "history.pt")
        self._report(summary, history)
        return 0

    @staticmethod
    def evaluate_cached(summary: dict) -> dict:
        return {k[: -len("_before")]: v for k, v in summary.items() if k.endswith("_before")}

    def _report(self, summary: dict, history: list[dict]) -> None:
        import json

        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        lines = [f"run finished: {self.step} steps, output in {self.out}"]
        if "eval/reward_mean_before" in summary and "eval/reward_mean_after" in summary:
            lines.append(f"held-out reward: {summary['eval/reward_mean_before']:.3f} -> {summary['eval/reward_mean_after']:.3f}"
                         f"   success rate: {summary['eval/success_rate_before']:.3f} -> {summary['eval/success_rate_after']:.3f}")
        if history:
            lines.append(f"training reward: first step {history[0].get('reward/mean', float('nan')):.3f}, "
                         f"last step {history[-1].get('reward/mean', float('nan')):.3f}")
        print("\n".join(lines), flush=True)
