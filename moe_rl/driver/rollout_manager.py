"""The rollout manager: vLLM engines as Ray actors, the prompt stream, and the weights they generate with.

    rollouts = Rollouts(cfg, place, spec, training_prompts(cfg, spec.env))  # spec: driver.specs.run_specs
    rollout = rollouts.generate(step)             # InFlight: the step's prompts split over the engines
    batch, metrics, episodes = rollouts.wait(rollout)  # one Batch; merged statistics; stale samples dropped
    rollouts.sync(policy, version)                # the policy's weights into every engine

Evaluation (held-out prompts) and the warm start's scripted-expert demonstrations live here too; the
prompt stream is driver/prompts.py's, the rollout's figures metrics.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray

from moe_rl.algos import correction
from moe_rl.batch import Batch, build_batch
from moe_rl.config import RunConfig
from moe_rl.driver.placement import Placement
from moe_rl.driver.prompts import generated_prompts
from moe_rl.driver.remote import RemoteCallError, gather, last_line
from moe_rl.driver.rollout_actor import RolloutActor
from moe_rl.driver.specs import RunSpecs
from moe_rl.metrics import evaluation_figures, token_version_figures
from moe_rl.rollout.seeds import sample_seed
from moe_rl.trajectory import Outcome, trajectory_from_state, trajectory_state

if TYPE_CHECKING:
    pass


class RolloutError(RuntimeError):
    """A step's rollout left nothing to train on."""


class EngineFailure(RemoteCallError):
    """An engine failed more times in a row than rollout.max_engine_restarts allows."""


@dataclass
class Call:
    """An engine call the driver waits on, kept so that it can go again to a replacement engine."""

    engine: int
    method: str
    args: tuple
    what: str  # for messages: "rollout of step 3", "weight update", ...
    ref: object = None
    actor: object = None  # the engine actor it went to


@dataclass
class Collected:
    """A rollout's results [(trajectories, RolloutStats)] per engine, finished (see `Rollouts.finish`),
    and how long the driver waited for them."""

    results: list
    wait_s: float = 0.0

    def state(self) -> dict:
        """In plain types and tensors: an asynchronous run's checkpoint keeps each rollout in flight."""
        return {"wait_s": self.wait_s, "results": [
            ([trajectory_state(t) for t in trajs],
             {"outcomes": dict(st.outcomes), "rejected": dict(st.rejected),
              "dropped_groups": st.dropped_groups, "overlong_filtered": st.overlong_filtered,
              "tool_errors": st.tool_errors, "memory": dict(st.memory), "first_error": st.first_error})
            for trajs, st in self.results]}

    @classmethod
    def from_state(cls, state: dict) -> Collected:
        from collections import Counter

        from moe_rl.rollout.agent import RolloutStats

        return cls([([trajectory_from_state(t) for t in trajs],
                     RolloutStats(**{**st, "outcomes": Counter(st["outcomes"]),
                                     "rejected": Counter(st["rejected"])}))
                    for trajs, st in state["results"]], state["wait_s"])


@dataclass
class InFlight:
    """A step's rollout once started: its engine calls while they run, its results (`done`) once waited
    for. `Rollouts.generate` starts one, `finish` completes it (a checkpoint keeps `done`), `wait` makes
    it the step's batch; a resumed run's comes back finished."""

    step: int
    calls: list[Call] = field(default_factory=list)
    done: Collected | None = None

    def __repr__(self) -> str:
        return (f"InFlight(step={self.step}, "
                f"{'finished' if self.done is not None else f'{len(self.calls)} calls'})")


class Rollouts:
    def __init__(self, cfg: RunConfig, place: Placement, run: RunSpecs, prompts: list[dict],
                 eval_prompts: list[dict] | None = None):
        """`run`: the engines', the agent loop's and the environment's specs (driver.specs.run_specs)."""
        self.cfg, self.transfer = cfg, cfg.rollout.weight_transfer
        self.engine_spec, self.agent_spec, self.env = run.engine, run.agent, run.env
        self.model_path = run.engine.model_path
        self.place = place
        self.engines = [self._start_engine(i) for i in range(cfg.rollout.num_engines)]  # starting: `started`
        self._infos = [e.info.remote() for e in self.engines]
        self.prompts, self.eval_prompts = prompts, eval_prompts or []
        self.data_pos = 0  # prompts consumed (saved with checkpoints)
        self.version = 0  # weight version the engines hold
        self.policy = None  # where the engines' current weights come from, once a sync gave them any
        self.restarts = 0  # engines replaced in this run
        self.failures = [0] * len(self.engines)  # failures in a row, per engine

    def started(self) -> None:
        """Wait until every engine has started (vLLM loaded its model)."""
        infos = gather([(f"engine {i} (start)", ref) for i, ref in enumerate(self._infos)],
                       self.cfg.cluster.start_timeout_s, setting="cluster.start_timeout_s")
        self.top_k, self.num_experts, self.nodes = (infos[0]["top_k"], infos[0]["num_experts"],
                                                    [i["node"] for i in infos])
        self.workers, self.threads = [i["workers"] for i in infos], [i["threads"] for i in infos]
        # a LoRA policy: "adapters" | "merged" (rollout.engine_spec.resolve_lora_sync) and why
        self.lora_sync, self.lora_sync_why = infos[0]["lora_sync"]

    def _start_engine(self, i: int):
        return RolloutActor.options(**self.place.options("engine", i)).remote(
            self.engine_spec, self.agent_spec, self.env,
            self.place.threads_of("engine", i), self.place.first_core(i))

    def connect(self, policy) -> None:
        """Open vLLM's weight transfer from the policy's rank 0 (weight_transfer nccl | ipc)."""
        if self.transfer != "store":
            policy.start_transfer(self.transfer, self.engines, self.workers,
                                  self.cfg.rollout.weight_sync_bucket_mb)

    def _gather(self, what: str, refs: list) -> list:
        return gather([(f"engine {i} ({what})", ref) for i, ref in enumerate(refs)],
                      self.cfg.cluster.call_timeout_s)

    # -- engine calls, and engines replaced when they fail -------------------------------------------

    def _submit(self, call: Call) -> Call:
        call.actor = self.engines[call.engine]
        call.ref = getattr(call.actor, call.method).remote(*call.args)
        return call

    def _run(self, calls: list[Call], settle: bool = True) -> list:
        """The calls' results, in order. An engine that dies, or whose weight update fails (vLLM cannot
        resume a half-finished one), is replaced (with the current weights) and its call goes again:
        the same arguments, so a rollout regenerates exactly the lost work (per-group seeds). `settle`:
        the calls' engines count as working again once they answer (not for a replacement's own load)."""
        def retry(k: int, err: Exception):
            call = calls[k]
            if call.actor is self.engines[call.engine]:  # else: its engine was replaced meanwhile
                if not (isinstance(err, RemoteCallError) or call.method == "update_weights"):
                    return None  # the call's own error, not the engine's
                self._replace(call.engine, err)
            if call.method == "update_weights":  # the replacement holds the current weights already
                return ray.put(0)
            return self._submit(call).ref

        out = gather([(f"engine {c.engine} ({c.what})", c.ref) for c in calls],
                     self.cfg.cluster.call_timeout_s, retry)
        if settle:
            for c in calls:
                self.failures[c.engine] = 0
        return out

    def _replace(self, i: int, err: Exception) -> None:
        """Engine i failed: a new one on its resources, with the engines' current weights; past
        rollout.max_engine_restarts failures of engine i in a row, EngineFailure."""
        limit, why = self.cfg.rollout.engine_restarts, last_line(err)
        self.failures[i] += 1
        if self.failures[i] > limit:
            raise EngineFailure(f"engine {i} failed {self.failures[i]} time(s) in a row "
                                f"(rollout.max_engine_restarts={limit}, weight_transfer={self.transfer}); "
                                f"last error: {why}")
        print(f"[moe-rl] engine {i} failed ({why}); starting a replacement on its resources "
              f"({self.failures[i]} of {limit} in a row)", flush=True)
        ray.kill(self.engines[i])  # a live engine whose update failed; a dead one: no-op
        self.engines[i] = self._start_engine(i)
        self.nodes[i] = gather([(f"engine {i} (start)", self.engines[i].info.remote())],
                               self.cfg.cluster.start_timeout_s, setting="cluster.start_timeout_s")[0]["node"]
        self.restarts += 1
        if self.policy is not None:  # the weights of the last sync (a new engine holds the base model's)
            self._load_weights(self.policy, [i], settle=False)

    # -- a step's rollout ---------------------------------------------------------------------------

    def generate(self, step: int) -> InFlight:
        """Start the step's rollout: its prompts (with dynamic sampling, the resample rounds' reserve
        too) split over the engines."""
        cfg, env = self.cfg, self.cfg.environment
        rounds = env.max_resample_rounds if env.dynamic_sampling else 0
        n = cfg.rollout.prompts_per_step * (1 + rounds)
        prompts = [self.prompts[(self.data_pos + i) % len(self.prompts)] for i in range(n)]
        self.data_pos += n
        k = len(self.engines)
        bounds = [n * i // k for i in range(k + 1)]
        seed = sample_seed(cfg.run.seed, "step", step)
        return InFlight(step, [self._submit(Call(i, "collect", (prompts[bounds[i]:bounds[i + 1]],
                                                               cfg.rollout.samples_per_prompt, seed, rounds,
                                                               bounds[i]),
                                                 f"rollout of step {step + 1}"))
                               for i in range(k) if bounds[i + 1] > bounds[i]])

    def finish(self, rollout: InFlight) -> Collected:
        """Wait for a rollout's results without building its batch (a checkpoint keeps them)."""
        if rollout.done is None:
            t0 = time.perf_counter()
            results = self._run(rollout.calls)
            rollout.done, rollout.calls = Collected(results, time.perf_counter() - t0), []
        return rollout.done

    def wait(self, rollout: InFlight) -> tuple[Batch, dict, list]:
        """The step's batch (samples more than rollout.max_staleness versions behind the engines'
        current weights dropped, in async mode, measured from a sample's oldest token), the rollout's
        figures, merged over the engines, and its trajectories."""
        from moe_rl.rollout.agent import RolloutStats

        done = self.finish(rollout)
        trajs, st, figures = [], RolloutStats(), {}
        for t, s in done.results:
            trajs.extend(t)
            st.outcomes.update(s.outcomes)
            st.rejected.update(s.rejected)
            st.dropped_groups += s.dropped_groups
            st.overlong_filtered += s.overlong_filtered
            st.tool_errors += s.tool_errors
            st.first_error = st.first_error or s.first_error
            st.counts.update(s.counts)
            for k, v in s.memory.items():  # the largest engine
                st.memory[k] = max(v, st.memory.get(k, 0.0))
        wait_s = done.wait_s
        if not trajs:
            first = f"; the first environment error: {st.first_error}" if st.first_error else ""
            raise RolloutError("no valid trajectories this step (rejected: "
                               f"{dict(st.rejected) or 'none'}){first}; "
                               "check the environment")
        if not self.cfg.rollout.async_mode and any(t.weight_version != self.version for t in trajs):
            raise RuntimeError(f"a synchronous rollout generated with weight versions "
                               f"{sorted({t.weight_version for t in trajs})}; every engine should hold "
                               f"version {self.version}: an engine missed a weight sync")
        batch = build_batch(trajs, self.top_k if self.cfg.rollout.record_routes else None,
                            list(self.cfg.teacher.all) if self.cfg.teachers else None)
        keep, stale = correction.staleness(batch.version_B, self.version,
                                           self.cfg.rollout.max_staleness if self.cfg.rollout.async_mode
                                           else None)
        if not bool(keep.all()):
            batch = batch.rows(keep.nonzero().squeeze(1))
        # every model's replicas need a row: the teachers' layout may have more of them
        dp = max(self.cfg.parallel.dp, self.cfg.teacher_parallel.dp if self.cfg.teachers else 1)
        if batch.size < dp:
            raise RolloutError(f"{batch.size} trajectories left this step ({int(stale['stale_dropped'])} too "
                               f"stale), fewer than the {dp} data-parallel replicas (of the policy or the "
                               "teachers); raise rollout.prompts_per_step")
        total = max(1, sum(st.outcomes.values()))
        for t in trajs:  # what the environment reported of each episode, as means over the step's (env/KEY)
            for k, v in t.info.get("figures", {}).items():
                figures.setdefault(f"env/{k}", []).append(v)
        return batch, {
            **{k: sum(v) / len(v) for k, v in figures.items()},
            **token_version_figures(trajs, self.version),
            "timing/generate_wait_s": wait_s,
            "perf/generate_tokens_per_s": sum(sum(t.response_mask) for t in trajs) / max(wait_s, 1e-9),
            "rollout/samples": batch.size, "rollout/rejected": sum(st.rejected.values()),
            "rollout/dropped_groups": st.dropped_groups, "rollout/tool_errors": st.tool_errors,
            "rollout/overlong_filtered": st.overlong_filtered, "rollout/engine_restarts": self.restarts,
            **{f"correction/{k}": v for k, v in stale.items()},
            # every outcome every step (0 when absent): charts never join distant points
            **{f"rollout/outcome_{k.value}": st.outcomes.get(k.value, 0) / total for k in Outcome},
            **{f"rollout/rejected_{reason}": n for reason, n in st.rejected.items()},
            **{f"rollout/{name}": n for name, n in st.counts.items()},
            **{f"memory/engine_{k.removeprefix('memory_')}": v for k, v in st.memory.items()},
        }, trajs

    # -- weights --------------------------------------------------------------------------------------

    def _all(self, method: str, *args) -> list:
        return self._run([self._submit(Call(i, method, args, method)) for i in range(len(self.engines))])

    def sleep(self) -> None:
        """Colocated with rollout.sleep_engines: every engine frees its GPU for the trainer."""
        if self.cfg.rollout.sleep_engines:
            self._all("sleep")

    def wake(self, part: str | None = None) -> None:
        """The engines take their GPU back: "weights" only (to receive a weight sync), or all of it."""
        if self.cfg.rollout.sleep_engines:
            self._all("wake", part)

    def sync(self, policy, version: int) -> dict[str, float]:
        """The policy's current weights into every engine, as weight version `version`; through the
        object store (weight_transfer=store), how long the trainer's export and the engines' loading
        took (timing/sync_export_s, sync_load_s)."""
        self.wake("weights")  # a sleeping engine's weights are in host memory: back on the GPU first
        self.version, self.policy = version, policy
        if self.transfer != "store":  # vLLM's transfer from trainer rank 0 into every engine worker
            policy.send_weights(version)
            return {}
        return self._load_weights(policy, range(len(self.engines)))

    def _load_weights(self, policy, engines, settle: bool = True) -> dict[str, float]:
        """The policy's weights, through Ray's object store, into the given engines, as version
        `self.version` (the store frees them once the refs are gone, after the update)."""
        t0 = time.perf_counter()
        adapters = self.lora_sync == "adapters"
        exported = policy.export_weights(self.cfg.rollout.weight_sync_bucket_mb, adapters)
        t1 = time.perf_counter()
        method = "update_adapters" if adapters else "update_weights"
        self._run([self._submit(Call(i, method, (exported, self.version), "weight update")) for i in engines],
                  settle)
        return {"timing/sync_export_s": t1 - t0, "timing/sync_load_s": time.perf_counter() - t1}

    # -- evaluation and demonstrations ---------------------------------------------------------------

    def evaluate(self) -> tuple[dict[str, float], list]:
        """The held-out prompts, trainer.eval_samples samples each (seeded apart from training), on
        engine 0: mean reward, success rate, pass@k (`evaluation_figures`), and the trajectories."""
        # the same at every evaluation
        n, seed = self.cfg.trainer.eval_samples, sample_seed(self.cfg.run.seed, "eval")
        greedy = self.cfg.trainer.eval_greedy
        trajs, _ = self._run([self._submit(Call(0, "collect", (self.eval_prompts, n, seed, 0, 0, greedy),
                                                "evaluation"))])[0]
        return evaluation_figures(trajs, len(self.eval_prompts), n), trajs

    def scripted_agent(self, turn):
        """The agent loop with a scripted player in the engine's place (ExpertPolicy playing
        `turn(conversation, rng)`: the warm start's expert or a reference policy), run in this process."""
        from transformers import AutoTokenizer

        from moe_rl.rollout.agent import Agent
        from moe_rl.rollout.demos import ExpertPolicy

        tok = AutoTokenizer.from_pretrained(self.model_path)
        expert = ExpertPolicy(tok, turn, self.cfg.run.seed, self.cfg.rollout.max_new_tokens)
        return Agent(expert, tok, self.env, self.agent_spec)

    def baselines(self) -> dict[str, dict[str, float]]:
        """The environment's reference policies (Environment.reference_policies: chance, optimal, ...) on
        the held-out prompts, trainer.eval_samples episodes each as the evaluation plays them, through the
        same agent loop, in this process: their evaluation figures (`evaluation_figures`) by name."""
        import asyncio

        if not self.eval_prompts:
            return {}
        n, out = self.cfg.trainer.eval_samples, {}
        for name, turn in self.env.env_cls.reference_policies().items():
            groups = asyncio.run(self.scripted_agent(turn).run_groups(self.eval_prompts, n))
            out[name] = evaluation_figures([t for g in groups for t in g], len(self.eval_prompts), n)
        return out

    def demonstrations(self, steps: int, rows: int, policy: str = "") -> list[Batch]:
        """`steps` batches of `rows` episodes played by the environment's scripted expert (or its reference
        policy named `policy`) through the same agent loop (same chat template, observations and masks as
        RL), run in this process; on prompts the environment makes (a seed of their own), or the training
        rows."""
        import asyncio
        import random

        cfg = self.cfg
        env_cls = self.env.env_cls
        agent = self.scripted_agent(env_cls.reference_policies()[policy] if policy else env_cls.expert_turn)
        if env_cls.generates_prompts():
            prompts = generated_prompts(self.env, steps * rows, cfg.run.seed + 31337)
        else:
            rng = random.Random(cfg.run.seed + 31337)
            prompts = [self.prompts[rng.randrange(len(self.prompts))] for _ in range(steps * rows)]
        return [build_batch([t for g in asyncio.run(agent.run_groups(prompts[i * rows:(i + 1) * rows], 1))
                             for t in g], None)
                for i in range(steps)]
