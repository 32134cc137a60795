"""The rollout manager: vLLM engines as Ray actors, the prompt stream, and the weights they generate with.

    rollouts = Rollouts(cfg, place, model_path)
    pending = rollouts.generate(step)             # the step's prompts split over the engines
    batch, metrics = rollouts.wait(pending)       # one Batch; merged statistics; stale samples dropped
    rollouts.sync(policy, version)                # the policy's weights into every engine

Evaluation (held-out prompts) and the warm start's scripted-expert demonstrations live here too.
"""

from __future__ import annotations

import os
import time

import torch

from moe_rl import settings
from moe_rl.algos import correction
from moe_rl.batch import Batch, build_batch
from moe_rl.cluster import Placement, RolloutActor, gather
from moe_rl.config import RunConfig
from moe_rl.types import Outcome


class RolloutError(RuntimeError):
    """A step's rollout left nothing to train on."""


def token_version_figures(trajectories: list, current: int) -> dict[str, float]:
    """Per-token weight versions of a step's model tokens against the engines' `current` version: the
    share of trajectories whose tokens come from several versions (a sync landed mid-conversation), and
    the age (current - version) of the tokens: mean, max, and the share sampled by the current weights."""
    ages, spanning = [], 0
    for t in trajectories:
        versions = t.versions or [t.weight_version] * len(t.token_ids)
        mine = [v for v, m in zip(versions, t.response_mask, strict=True) if m]
        spanning += len(set(mine)) > 1
        ages += [current - v for v in mine]
    return {"rollout/spanning_versions_frac": spanning / max(1, len(trajectories)),
            "rollout/token_age_mean": sum(ages) / max(1, len(ages)), "rollout/token_age_max": max(ages, default=0),
            "rollout/token_age_0_frac": sum(a == 0 for a in ages) / max(1, len(ages))}


class Rollouts:
    def __init__(self, cfg: RunConfig, place: Placement, model_path: str):
        from moe_rl.rollout.envs import get_env

        self.cfg, self.model_path, self.transfer = cfg, model_path, cfg.rollout.weight_transfer
        self.env_cls = get_env(cfg.environment.name)
        self.agent_settings = settings.agent_settings(cfg)
        self.engines = [RolloutActor.options(**place.options("engine", i)).remote(
            settings.engine_settings(cfg, model_path), self.agent_settings, cfg.environment.name, settings.env_options(cfg))
            for i in range(cfg.rollout.num_engines)]
        infos = self._gather("info", [e.info.remote() for e in self.engines])
        self.top_k, self.nodes = infos[0]["top_k"], [i["node"] for i in infos]
        self.workers = [i["workers"] for i in infos]
        self.prompts = self._load_prompts()
        self.data_pos = 0  # prompts consumed (saved with checkpoints)
        self.version = 0  # weight version the engines hold

    def _load_prompts(self) -> list[dict]:
        env = self.cfg.environment
        if env.dataset:
            from moe_rl.rollout.data import load_prompts

            return load_prompts(env.dataset)
        return self.env_cls.generate_prompts(100_000, seed=self.cfg.run.seed, **env.options)

    def connect(self, policy) -> None:
        """Open vLLM's weight transfer from the policy's rank 0 (weight_transfer nccl | ipc)."""
        if self.transfer != "files":
            policy.start_transfer(self.transfer, self.engines, self.workers)

    def _gather(self, what: str, refs: list) -> list:
        return gather([(f"engine {i} ({what})", ref) for i, ref in enumerate(refs)], self.cfg.cluster.call_timeout_s)

    # -- a step's rollout ---------------------------------------------------------------------------

    def generate(self, step: int) -> list:
        """Start the step's rollout: its prompts (with dynamic sampling, the resample rounds' reserve
        too) split over the engines. Returns the pending work for `wait`."""
        cfg, env = self.cfg, self.cfg.environment
        rounds = env.max_resample_rounds if env.dynamic_sampling else 0
        n = cfg.rollout.prompts_per_step * (1 + rounds)
        prompts = [self.prompts[(self.data_pos + i) % len(self.prompts)] for i in range(n)]
        self.data_pos += n
        k = len(self.engines)
        bounds = [n * i // k for i in range(k + 1)]
        seed = cfg.run.seed * 1000 + step
        return [
            (f"engine {i} (rollout of step {step + 1})",
             e.collect.remote(prompts[bounds[i]:bounds[i + 1]], cfg.rollout.samples_per_prompt, seed, rounds, bounds[i]))
            for i, e in enumerate(self.engines) if bounds[i + 1] > bounds[i]]

    def wait(self, pending: list) -> tuple[Batch, dict]:
        """The step's batch (samples more than rollout.max_staleness versions behind the engines'
        current weights dropped, in async mode, measured from a sample's oldest token) and the rollout's
        figures, merged over the engines."""
        from moe_rl.rollout.agent import RolloutStats

        t0 = time.perf_counter()
        trajs, st = [], RolloutStats()
        for t, s in gather(pending, self.cfg.cluster.call_timeout_s):
            trajs.extend(t)
            st.outcomes.update(s.outcomes)
            st.rejected.update(s.rejected)
            st.dropped_groups += s.dropped_groups
            st.overlong_filtered += s.overlong_filtered
            st.tool_errors += s.tool_errors
        wait_s = time.perf_counter() - t0
        if not trajs:
            raise RolloutError(f"no valid trajectories this step (rejected: {dict(st.rejected) or 'none'}); "
                               "check the environment")
        batch = build_batch(trajs, self.top_k if self.cfg.rollout.record_routes else None)
        keep, stale = correction.staleness(batch.version_B, self.version,
                                           self.cfg.rollout.max_staleness if self.cfg.rollout.async_mode else None)
        if not bool(keep.all()):
            batch = batch.rows(keep.nonzero().squeeze(1))
        dp = self.cfg.parallel.dp
        if batch.size < dp:
            raise RolloutError(f"{batch.size} trajectories left this step ({int(stale['stale_dropped'])} too stale), "
                               f"fewer than the {dp} data-parallel replicas; raise rollout.prompts_per_step")
        total = max(1, sum(st.outcomes.values()))
        return batch, {
            **token_version_figures(trajs, self.version),
            "timing/generate_wait_s": wait_s,
            "perf/generate_tokens_per_s": sum(sum(t.response_mask) for t in trajs) / max(wait_s, 1e-9),
            "rollout/samples": batch.size, "rollout/rejected": sum(st.rejected.values()),
            "rollout/dropped_groups": st.dropped_groups, "rollout/tool_errors": st.tool_errors,
            "rollout/overlong_filtered": st.overlong_filtered,
            **{f"correction/{k}": v for k, v in stale.items()},
            # every outcome every step (0 when absent): charts never join distant points
            **{f"rollout/outcome_{k.value}": st.outcomes.get(k.value, 0) / total for k in Outcome},
            **{f"rollout/rejected_{reason}": n for reason, n in st.rejected.items()},
        }

    # -- weights --------------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Colocated with rollout.sleep_engines: every engine frees its GPU for the trainer."""
        if self.cfg.rollout.sleep_engines:
            self._gather("sleep", [e.sleep.remote() for e in self.engines])

    def wake(self, part: str | None = None) -> None:
        """The engines take their GPU back: "weights" only (to receive a weight sync), or all of it."""
        if self.cfg.rollout.sleep_engines:
            self._gather("wake", [e.wake.remote(part) for e in self.engines])

    def sync(self, policy, version: int) -> None:
        """The policy's current weights into every engine, as weight version `version`."""
        from moe_rl.weights.sync import shm_dir

        self.wake("weights")  # a sleeping engine's weights are in host memory: back on the GPU first
        self.version = version
        if self.transfer != "files":  # vLLM's transfer from trainer rank 0 into every engine worker
            policy.send_weights(version)
            return
        d = str(shm_dir() / f"moe_rl_sync_{os.getpid()}_{version}")
        exported = policy.export_weights(d, self.cfg.rollout.weight_sync_bucket_mb)
        self._gather("weight update", [e.update_weights.remote(policy.buckets_for(exported, node), version)
                                       for e, node in zip(self.engines, self.nodes, strict=True)])
        policy.drop_weights(d)

    # -- evaluation and demonstrations ---------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Mean reward on held-out prompts (a seed the training prompts never use), one sample each,
        on engine 0."""
        env = self.cfg.environment
        prompts = self.env_cls.generate_prompts(self.cfg.trainer.eval_prompts, seed=self.cfg.run.seed + 424242,
                                                **env.options)
        trajs, _ = self._gather("evaluation", [self.engines[0].collect.remote(prompts, 1, 99991, 0)])[0]
        return {"eval/reward_mean": float(torch.tensor([t.total_reward for t in trajs]).mean()),
                "eval/success_rate": float(torch.tensor([float(t.terminal_reward > 0) for t in trajs]).mean()),
                "eval/samples": len(trajs)}

    def demonstrations(self, steps: int, rows: int) -> list[Batch]:
        """`steps` batches of `rows` episodes played by the environment's scripted expert through the
        same agent loop (same chat template, observations and masks as RL), run in this process."""
        import asyncio

        from transformers import AutoTokenizer

        from moe_rl.rollout.agent import Agent
        from moe_rl.rollout.demos import ExpertPolicy

        cfg = self.cfg
        tok = AutoTokenizer.from_pretrained(self.model_path)
        agent = Agent(ExpertPolicy(tok, self.env_cls, cfg.run.seed), tok, self.env_cls, dict(cfg.environment.options),
                      self.agent_settings)
        prompts = self.env_cls.generate_prompts(steps * rows, seed=cfg.run.seed + 31337, **cfg.environment.options)
        return [build_batch([t for g in asyncio.run(agent.run_groups(prompts[i * rows:(i + 1) * rows], 1)) for t in g], None)
                for i in range(steps)]
