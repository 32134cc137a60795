"""One vLLM engine and the agent loop as a Ray actor (RolloutActor), the error an engine's refused
settings raise, and the client through which a trainer rank drives the engines' weight transfer.

RolloutActor runs in a process of its own (Ray's worker; vLLM's own worker processes beside it with
engine tensor parallelism), not the driver's; EngineSyncClient runs in a trainer rank's."""

from __future__ import annotations

import os

import ray
import torch

from moe_rl.driver.placement import use_threads
from moe_rl.driver.remote import last_line
from moe_rl.driver.session import failpoint


class EngineSyncClient:
    """vLLM's VLLMWeightSyncClient protocol over our engine actors: what the trainer's sender calls to
    drive each round. Under NCCL, engine i's workers join the group at rank offsets[i]; the round's
    weight version (set before sending) reaches the engines with the finish."""

    def __init__(self, engines: list, offsets: list[int]):
        self.engines, self.offsets, self.version = engines, offsets, None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        ray.get([e.transfer.remote("init_weight_transfer_engine",
                                   {**init_info, "rank_offset": off} if "rank_offset" in init_info
                                   else init_info)
                 for e, off in zip(self.engines, self.offsets, strict=True)])

    def start_weight_update(self) -> None:
        ray.get([e.transfer.remote("start_weight_update") for e in self.engines])

    def update_weights(self, update_info: dict) -> None:
        ray.get([e.transfer.remote("update_weights", update_info) for e in self.engines])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        ray.get([e.transfer.remote("finish_weight_update", None, self.version) for e in self.engines])


class EngineStartError(ValueError):
    """vLLM refused an engine's settings at start-up (a user's mistake: exit 2); its message, one line."""


def vllm_refusal(err: ValueError) -> str:
    """vLLM's own words for a refused setting: pydantic's first error message (vLLM validates its configs
    with pydantic), else the error's last line."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        try:
            return str(errors()[0]["msg"]).removeprefix("Value error, ")
        except (IndexError, KeyError, TypeError):
            pass
    return last_line(err)


@ray.remote
class RolloutActor:
    """A vLLM engine and the agent loop, as an asyncio actor: rollouts run as coroutines, and a weight
    update arriving meanwhile runs between engine steps (in-flight conversations pause, then resume
    with the new weights; each trajectory keeps the version it started with). An engine whose settings
    vLLM refuses stays alive to say so: `info` raises EngineStartError (a dead actor would read as a
    fault)."""

    def __init__(self, settings, agent_spec, env, threads: int, first_core: int = 0):
        use_threads(threads)  # before vLLM starts: its CPU worker refuses later changes
        from transformers import AutoTokenizer

        from moe_rl.rollout.agent import Agent
        from moe_rl.rollout.engine import RolloutEngine

        self.refused = ""
        try:
            self.engine = RolloutEngine(settings, threads, first_core)
        except ValueError as err:  # pydantic's ValidationError too
            self.refused = vllm_refusal(err)
            return
        tok = AutoTokenizer.from_pretrained(settings.model_path)
        # env: rollout.envs.EnvSpec; a gateway (environment.name gateway) serves on this node's address
        self.agent = Agent(self.engine, tok, env, agent_spec, ray.util.get_node_ip_address())
        self.top_k = self.engine.top_k

    async def collect(self, prompts: list[dict], samples_per_prompt: int, seed: int, dynamic: int = 0,
                      first_group_id: int = 0, greedy: bool = False):
        """`greedy`: decode at temperature 0 (trainer.eval_greedy's evaluation)."""
        import copy
        import dataclasses

        from moe_rl.rollout.agent import RolloutStats

        agent = copy.copy(self.agent)  # statistics of this call only: an evaluation may run beside a rollout
        agent.stats = RolloutStats()
        if greedy:
            agent.s = dataclasses.replace(agent.s, temperature=0.0)
        if dynamic:
            pool = list(prompts)

            def next_prompts(k):
                out = pool[:k]
                del pool[:k]
                return out

            groups = await agent.dynamic_sampling(next_prompts, len(prompts) // (dynamic + 1) or 1,
                                                  samples_per_prompt, dynamic, seed, first_group_id)
        else:
            groups = await agent.run_groups(prompts, samples_per_prompt, seed, first_group_id)
        from moe_rl.metrics import process_memory

        agent.stats.memory = process_memory()
        return [t for g in groups for t in g], agent.stats

    async def update_weights(self, buckets: list, version: int) -> int:
        """Load weight buckets: refs to them in Ray's object store (TrainerGroup.export_weights), read
        where they lie on this node, received from other nodes. They are fetched first; the update
        itself is one engine call between two engine steps (in-flight conversations pause, never see
        half-updated weights, and resume with the new version)."""
        from moe_rl.weights.sync import from_buffers, shm_dir

        sources = [await b for b in buckets]

        def loaded():
            for k, src in enumerate(sources):
                if k == len(sources) // 2:
                    failpoint("engine_update")  # halfway: some layers new, the rest old
                yield from_buffers(src)

        if self.engine.settings.tensor_parallel_size == 1:  # the engine's one worker is this process
            return self.engine.update_weights((t for bucket in loaded() for t in bucket), version)
        # tensor parallel: the engine's workers are processes of their own; each bucket reaches them as a
        # file in this node's shared memory, one at a time, each worker reading its shard of it
        return self.engine.update_weights_through_files(loaded(), version,
                                                        shm_dir() / f"moe_rl_update_{os.getpid()}_{version}")

    async def update_adapters(self, buckets: list, version: int) -> int:
        """Load the policy's LoRA adapters (refs to their buckets, as `update_weights` takes them) as a new
        vLLM adapter for weight version `version` (the engine's lora_sync is adapters)."""
        from moe_rl.weights.sync import from_buffers

        sources = [await b for b in buckets]
        return self.engine.update_adapters((t for src in sources for t in from_buffers(src)), version)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self, part: str | None = None) -> None:
        self.engine.wake(part)

    def transfer(self, call: str, payload: dict | None = None, version: int | None = None) -> None:
        """A step of vLLM's weight transfer (under NCCL, update_weights blocks while the trainer
        broadcasts)."""
        self.engine.transfer(call, payload, version)

    def info(self) -> dict:
        if self.refused:
            raise EngineStartError(f"vLLM refused the engine's settings: {self.refused}")
        return {"top_k": self.engine.top_k, "num_experts": self.engine.num_experts,
                "moe_layers": self.engine.num_moe_layers, "version": self.engine.version,
                "node": ray.util.get_node_ip_address(), "threads": torch.get_num_threads(),
                "workers": self.engine.llm.llm_engine.vllm_config.parallel_config.world_size,
                "lora_sync": (self.engine.lora_sync, self.engine.lora_sync_why)}
