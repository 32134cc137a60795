"""Ray placement: trainer ranks (policy, critic, reference) and rollout engines as actors.

One machine: the run starts a local Ray (the default). A cluster: `cluster.address` (or RAY_ADDRESS)
names it. Colocated placement (the default) time-shares the same CPUs/GPUs: actors reserve no CPU so
trainers and engines fit on a 2-core box; separate placement gives each group its own resources.
Inside a trainer group, torch.distributed (gloo on CPU, NCCL on GPU) connects the ranks.
"""

from __future__ import annotations

import asyncio
import os
import socket

import ray
import torch

from moe_rl.config import RunConfig


def start_ray(cfg: RunConfig) -> None:
    if ray.is_initialized():
        return
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    env = {"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
                        "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(
                            [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=False)
    else:
        ray.init(num_cpus=cfg.cluster.num_cpus or os.cpu_count(), include_dashboard=False, runtime_env=env,
                 log_to_driver=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ray.remote
class TrainActor:
    """One rank of a Megatron trainer group."""

    def __init__(self, rank: int, world: int, addr: str, port: int, spec, role: str, optim, seed: int, layout,
                 load_weights: bool = True):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR=addr, MASTER_PORT=str(port))
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        from moe_rl.train import parallel
        from moe_rl.train.worker import TrainWorker

        parallel.init_distributed(layout)
        self.worker = TrainWorker(spec, role=role, optim=optim, seed=seed, load_weights=load_weights)
        self.anchor = None

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def score(self, batch, record_routes: bool = False, anchor: bool = False):
        if anchor and self.anchor is not None:
            return self.worker.score_with(self.anchor.params, batch)
        return self.worker.score(batch, record_routes=record_routes)

    def train(self, batch, loss: tuple, denominator):
        from moe_rl.train import actor

        kind, spec = loss
        fn = {"policy": lambda: actor.policy_loss_fn(spec), "value": lambda: actor.value_loss_fn(spec),
              "sft": actor.sft_loss_fn}[kind]()
        metrics = self.worker.train_step(batch, fn, denominator)
        if self.anchor is not None and kind == "policy":
            self.anchor.update(self.worker.local_params())  # after the step: theta_n never anchors its own loss
        return metrics

    def set_lr(self, lr: float) -> None:
        for group in self.worker.optimizer.param_groups:
            group["lr"] = lr

    def init_anchor(self, beta: float) -> None:
        from moe_rl.algos.anchor import EwmaAnchor

        self.anchor = EwmaAnchor(self.worker.local_params(), beta)

    def export_weights(self, directory: str, bucket_mb: float) -> list[str]:
        from moe_rl.weights.hf import export_hf_weights
        from moe_rl.weights.sync import buckets, write_bucket

        named = export_hf_weights(self.worker.bridge, self.worker.module)
        paths = [str(write_bucket(b, directory, i)) for i, b in enumerate(buckets(named, bucket_mb))]
        ps = self.worker.ps
        owner = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
        if not owner:  # every (pp, ep) owner writes its own layers once
            for p in paths:
                os.unlink(p)
            return []
        return paths

    def save(self, path: str, extra: dict) -> None:
        from moe_rl.train import checkpoint

        if self.anchor is not None:
            extra = dict(extra, anchor=self.anchor.state_dict())
        checkpoint.save(self.worker, path, extra)

    def load(self, path: str) -> dict:
        from moe_rl.train import checkpoint

        extra = checkpoint.load(self.worker, path)
        if self.anchor is not None and "anchor" in extra:
            self.anchor.load_state_dict(extra["anchor"])
        return extra


class TrainerGroup:
    def __init__(self, cfg: RunConfig, spec, role: str, optim, seed: int, load_weights: bool = True):
        from moe_rl.train.parallel import Layout

        par = cfg.parallel
        layout = Layout(tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp)
        world = par.world_size
        port = _free_port()
        res = {"num_cpus": 0} if cfg.cluster.colocate else {"num_cpus": 1}
        if torch.cuda.is_available():
            res["num_gpus"] = 0.5 if cfg.cluster.colocate else 1
        self.actors = [TrainActor.options(**res).remote(r, world, "127.0.0.1", port, spec, role, optim, seed, layout,
                                                        load_weights) for r in range(world)]
        self.dp = par.dp
        self.world = world
        self.tp_cp = par.tp * par.cp
        ray.get([a.node.remote() for a in self.actors])

    def _shard(self, batch, rank: int):
        """Each DP replica gets its rows; TP/PP ranks of one replica get the same rows."""
        if self.dp == 1:
            return batch
        dp_rank = (rank // self.tp_cp) % self.dp  # megatron's rank order: tp, cp, (ep), dp, pp
        B = batch.input_ids_BS.shape[0]
        rows = slice(dp_rank * B // self.dp, (dp_rank + 1) * B // self.dp)
        return batch.rows(rows)

    def score(self, batch, **kw):
        outs = ray.get([a.score.remote(batch, **kw) for a in self.actors])
        return outs[0]

    def train(self, batch, loss, denominator):
        outs = ray.get([a.train.remote(self._shard(batch, r), loss, denominator) for r, a in enumerate(self.actors)])
        merged = {}
        for o in outs:
            for k, v in o.items():
                merged.setdefault(k, []).append(v)
        losses = [o["loss"] for o in outs if "loss" in o]  # last-stage ranks: tp*cp per data-parallel replica
        merged = {k: sum(v) / len(v) for k, v in merged.items()}
        if losses:
            merged["loss"] = sum(losses) / self.tp_cp  # each replica's share of the global loss, summed
        return merged

    def call(self, method: str, *args):
        return ray.get([getattr(a, method).remote(*args) for a in self.actors])


@ray.remote
class RolloutActor:
    """A vLLM engine and the agent loop, as an asyncio actor: rollouts run as coroutines, and a weight
    update arriving meanwhile runs between engine steps (in-flight conversations pause, then resume
    with the new weights; each trajectory keeps the version it started with)."""

    def __init__(self, settings, agent_settings, env_name: str, env_options: dict):
        from transformers import AutoTokenizer

        from moe_rl.rollout.agent import Agent
        from moe_rl.rollout.engine import RolloutEngine
        from moe_rl.rollout.envs import get_env

        self.engine = RolloutEngine(settings)
        tok = AutoTokenizer.from_pretrained(settings.model_path)
        self.agent = Agent(self.engine, tok, get_env(env_name), env_options, agent_settings)
        self.top_k = self.engine.top_k
        self.settings = agent_settings

    def agent_settings(self):
        return self.settings

    async def collect(self, prompts: list[dict], samples_per_prompt: int, seed: int, dynamic: int = 0,
                      first_group_id: int = 0):
        from moe_rl.rollout.agent import RolloutStats

        self.agent.stats = RolloutStats()
        if dynamic:
            pool = list(prompts)

            def next_prompts(k):
                out = pool[:k]
                del pool[:k]
                return out

            groups = await self.agent.dynamic_sampling(next_prompts, len(prompts) // (dynamic + 1) or 1,
                                                       samples_per_prompt, dynamic, seed, first_group_id)
        else:
            groups = await self.agent.run_groups(prompts, samples_per_prompt, seed, first_group_id)
        return [t for g in groups for t in g], self.agent.stats

    async def update_weights(self, paths: list[str], version: int) -> int:
        from moe_rl.weights.sync import read_bucket

        n = 0
        for p in paths:  # files stay for the other engines; the driver removes the directory
            n += self.engine.update_weights(read_bucket(p, delete=False), version)
            await asyncio.sleep(0)
        return n

    def info(self) -> dict:
        return {"top_k": self.engine.top_k, "moe_layers": self.engine.num_moe_layers, "version": self.engine.version}
