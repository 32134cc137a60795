"""One trainer rank as a Ray actor (RankActor): its TrainWorker plus the EWMA anchor, the weight export
and the checkpoint I/O of that rank.

Runs in a process of its own (Ray's worker), not the driver's: the driver holds a handle and calls it
with `.remote`; what it imports loads there."""

from __future__ import annotations

import os
import time

import ray
import torch

import moe_rl
from moe_rl.driver.placement import _free_address, use_threads
from moe_rl.driver.rollout_actor import EngineSyncClient
from moe_rl.driver.session import failpoint


@ray.remote
class RankActor:
    """One rank of a trainer group, as a Ray actor: its TrainWorker (the Megatron model, optimizer,
    forward and update) plus the EWMA anchor, weight export and checkpoint I/O of that rank."""

    def __init__(self, rank: int, world: int, addr: str, port: int, spec, role: str, optim, seed: int, layout,
                 threads: int, load_weights: bool = True, value_head_from: str | None = None,
                 trains: bool = True):
        from moe_rl.train import parallel
        from moe_rl.train.model import import_megatron

        import_megatron(spec.layer_spec)

        # the GPU Ray gave this actor, by its index among the devices this process sees (not the rank)
        device = parallel.local_device_index(os.environ.get("CUDA_VISIBLE_DEVICES"), ray.get_gpu_ids())
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank if device is None else device), MASTER_ADDR=addr,
                          MASTER_PORT=str(port))
        use_threads(threads)
        from moe_rl.train.worker import TrainWorker

        parallel.init_distributed(layout)
        self.rank, self.world = rank, world
        self.transfer = None
        self.worker = TrainWorker(spec, role=role, optim=optim, seed=seed, load_weights=load_weights,
                                  value_head_from=value_head_from, trains=trains)
        self.anchor = None
        moe_rl.started()

    def placed(self) -> tuple[str, int]:
        """(this rank's node IP, its CPU threads)."""
        return ray.util.get_node_ip_address(), torch.get_num_threads()

    def score(self, batch, record_routes: bool = False, anchor: bool = False, adapters: bool = True):
        """train.results.ScoreResult of this rank's shard (with its wall time); `anchor`: with the EWMA
        anchor's weights; adapters=False: a LoRA policy as its frozen base."""
        t0 = time.perf_counter()
        if anchor and self.anchor is not None:
            out = self.worker.score_with(self.anchor.params, batch)
        else:
            out = self.worker.score(batch, record_routes=record_routes, adapters=adapters)
        out.seconds = time.perf_counter() - t0
        return out

    def train(self, batch, loss, denominator, keep_logp: bool = False):
        """One optimizer update with `loss` (a train.objectives type) on this rank's shard: its
        train.results.UpdateResult, the rank's memory among the figures."""
        from moe_rl.metrics import process_memory
        from moe_rl.train.objectives import PolicyLoss

        update = self.worker.train_step(batch, loss, denominator, keep_logp)
        if self.anchor is not None and isinstance(loss, PolicyLoss) \
                and not update.figures["skipped_nonfinite"]:
            # after the step: theta_n never anchors its own loss
            self.anchor.update(self.worker.local_params())
        update.figures |= process_memory()
        moe_rl.release_free_heap()
        return update

    def memory(self) -> dict[str, float]:
        """This rank's memory (metrics.process_memory); the train call reports it too."""
        from moe_rl.metrics import process_memory

        return process_memory()

    def offload(self) -> int:
        return self.worker.offload(list(self.anchor.params.values()) if self.anchor is not None else [])

    def onload(self) -> None:
        self.worker.onload()

    def set_lr(self, lr: float) -> None:
        self.worker.set_lr(lr)

    def init_anchor(self, beta: float) -> None:
        from moe_rl.algos.anchor import EwmaAnchor

        self.anchor = EwmaAnchor(self.worker.local_params(), beta)

    def export_weights(self, bucket_mb: float, adapters: bool = False) -> list:
        """The tensors this rank owns (each (pp, ep) shard once) as buckets in Ray's object store
        (weights.sync.as_buffers), a ref each; all ranks take part (TP shards are gathered). The store
        frees a bucket once the engines have loaded it and the driver lets go of its ref. adapters: the
        LoRA adapters alone (PEFT names), else the weights (merged with the adapters, where any)."""
        from moe_rl.train.hf_io import export_hf_weights, export_peft_adapters
        from moe_rl.weights.sync import as_buffers, buckets

        offloaded = self.worker.offloaded  # a replacement engine's weights, asked for during a rollout
        if offloaded:
            self.onload()
        try:
            w = self.worker
            named = export_peft_adapters(w.bridge, w.module, owned_only=True) if adapters \
                else export_hf_weights(w.bridge, w.module, owned_only=True)
            refs = []
            for i, b in enumerate(buckets(named, bucket_mb)):
                # copied into the store here: the weights may change after
                refs.append(ray.put(as_buffers(b)))
                if i == 0:
                    failpoint("trainer_export")  # once per export, after its first bucket
            return refs
        finally:
            if offloaded:
                self.offload()

    def start_transfer(self, backend: str, engines: list, world_size: int, offsets: list[int],
                       bucket_mb: float) -> None:
        """Join vLLM's weight transfer (rank 0 sends; every rank takes part in the export; ipc stages
        bucket_mb at a time)."""
        from moe_rl.rollout.transfer import ExportSource, GatheredExport, start_transfer
        from moe_rl.train.hf_io import export_hf_weights

        w = self.worker
        source = GatheredExport(lambda: export_hf_weights(w.bridge, w.module, owned_only=True)) \
            if backend == "nccl" \
            else ExportSource(lambda: export_hf_weights(w.bridge, w.module))
        addr, port = _free_address() if self.rank == 0 else ("", 0)
        client = EngineSyncClient(engines, offsets) if self.rank == 0 else None
        self.transfer = start_transfer(backend, source, client, self.rank, addr, port, world_size, bucket_mb)

    def send_weights(self, version: int) -> None:
        if self.transfer.client is not None:
            self.transfer.client.version = version
        self.transfer.send_weights()

    def _anchor_file(self, path: str) -> str:
        return os.path.join(path, f"ewma_anchor_rank{self.rank:05d}.pt")

    def save(self, path: str, extra: dict) -> None:
        from moe_rl.train import checkpoint

        checkpoint.save(self.worker, path,
                        dict(extra, anchor_ranks=self.world if self.anchor is not None else 0))
        if self.anchor is not None:  # this rank's shards of the EWMA anchor (each rank holds other tensors)
            torch.save(self.anchor.state_dict(), self._anchor_file(path))

    def load(self, path: str) -> dict:
        from moe_rl.train import checkpoint

        extra = checkpoint.load(self.worker, path)
        if self.anchor is not None and extra.get("anchor_ranks"):
            if extra["anchor_ranks"] != self.world:
                raise checkpoint.CheckpointError(
                    f"{path}: its EWMA anchor was saved by {extra['anchor_ranks']} trainer ranks, this run "
                    f"has {self.world}; resume it with the layout it was saved with")
            self.anchor.load_state_dict(torch.load(self._anchor_file(path), weights_only=True))
        return extra
