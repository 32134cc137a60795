"""One rank of a Megatron policy or critic: model, DDP, optimizer, scoring and training steps.

    w = TrainWorker(specs.model_spec(cfg, hf_path), role="policy",
                    optim=specs.optim_spec(cfg, cfg.trainer.lr, cfg.trainer.lr_mult))
    out = w.score(batch)                                # forward only: ScoreResult (logp/entropy or critic
                                                        # outputs)
    update = w.train_step(batch, loss_fn, denominator)  # forward+backward over microbatches, step:
                                                        # UpdateResult

Batches are this data-parallel rank's shard; every TP/PP rank of one replica receives the same shard.
Microbatches run through megatron-core's `get_forward_backward_func` (pipeline schedules included).
With `pack_sequences` a microbatch's rows reach the model packed end to end (THD, train/packing.py);
the loss functions still see [b, s] tensors.

Loss scaling. megatron divides each microbatch loss by the number of microbatches and averages
gradients over data-parallel ranks. Our losses use explicit global denominators (algos/aggregate.py):
the loss of a microbatch is numerator / global_denominator, and the gradient must be the plain sum
over microbatches and ranks. So the worker multiplies by (microbatches x dp) before handing the loss
to megatron, which divides it out again: one explicit factor instead of a hidden mean. Under context
parallelism every CP rank computes the whole loss from gathered outputs (train/context.py), and the
factor also divides out the cp megatron multiplies in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from moe_rl.batch import Batch
from moe_rl.metrics import reduce_updates
from moe_rl.train import cpu_compat, lora, parallel, replay
from moe_rl.train import model as model_lib
from moe_rl.train.context import gather_sequence, local_positions
from moe_rl.train.logprobs import (
    chunked_target_logprobs,
    hidden_out,
    last_hidden,
    output_weight,
    target_logprobs,
)
from moe_rl.train.offload import HostCopies, storages
from moe_rl.train.optim import (
    OptimSpec,
    apply_lr_mult,
    lr_mult_overrides,
    lr_mult_setting,
    optimizer_config,
    uses_distributed_optimizer,
)
from moe_rl.train.packing import FP8_ALIGN, Packing, token_multiple
from moe_rl.train.results import ScoreResult, UpdateResult
from moe_rl.trajectory import route_torch_dtype


class TrainWorker:
    def __init__(self, spec: model_lib.ModelSpec, role: str = "policy", *, optim: OptimSpec,
                 seed: int = 1234, load_weights: bool = True, value_head_from: str | None = None,
                 trains: bool = True):
        """`trains`=False: a model that only scores (the reference policy, a reward model, a teacher): no
        gradient buffers, no optimizer state; `optim` still sets its microbatching."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.transformer.moe.router_replay import RouterReplay

        from moe_rl.train import hf_io as hf

        if role not in ("policy", "critic"):
            raise ValueError(f"role must be 'policy' or 'critic', not {role!r}")
        if spec.lora is not None and not load_weights:
            raise ValueError("a LoRA policy's frozen base is its Hugging Face checkpoint (checkpoints hold "
                             "the adapters alone): load_weights must be on")
        cpu_compat.apply()
        parallel.seed_model_parallel(seed)
        self.spec, self.role, self.optim_spec = spec, role, optim
        RouterReplay.clear_global_router_replay_instances()  # process-wide registry: one model per process
        self.bridge = model_lib.make_bridge(spec)
        self.config = self.bridge.config
        module = model_lib.build_gpt(self.bridge, spec, critic=role == "critic")
        self.replay_instances = list(RouterReplay.global_router_replay_instances)
        self.moe_layer_ids = replay.moe_layer_ids(module, self.config)
        if load_weights:
            hf.load_hf_weights(self.bridge, module, spec.hf_path, skip_output_layer=role == "critic")
            if role == "critic" and value_head_from and ps.is_pipeline_last_stage():
                hf.load_value_head(module, value_head_from)
        if spec.lora is not None:  # the base frozen, adapters the only trainable parameters
            lora.add_adapters(module, spec.lora, hf.rank_names(module, self.config.num_moe_experts), seed)
        self.model, self.optimizer = module, None
        if trains:
            names = hf.rank_names(module, self.config.num_moe_experts) if optim.lr_mult else {}
            apply_lr_mult(module, optim.lr_mult, lr_mult_setting(role), names)  # factors of 0 freeze
            distributed = uses_distributed_optimizer(optim, ps.get_data_parallel_world_size())
            self.ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed)
            self.model = DistributedDataParallel(config=self.config, ddp_config=self.ddp_config,
                                                 module=module)
            optim_config = optimizer_config(optim, distributed, spec.torch_dtype)
            overrides = lr_mult_overrides(optim_config, optim.lr_mult, names)
            self.optimizer = get_megatron_optimizer(optim_config, [self.model], config_overrides=overrides)
            self.set_lr(optim.lr)
            # megatron's schedules call these: gradient sync across DP, SP/qk-norm grads across TP,
            # embedding grads across the pipeline
            from megatron.core.distributed import finalize_model_grads

            self.config.finalize_model_grads_func = finalize_model_grads
            self.config.no_sync_func = self.model.no_sync
        else:
            module.requires_grad_(False)
        self.ps = ps
        # where this rank computes: batches arrive on the CPU (from Ray) and are moved here in one place
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.cp = ps.get_context_parallel_world_size()
        self._packings: dict[int, Packing] = {}
        self.steps = 0
        self._recording: list[torch.Tensor] | None = None
        self._host = HostCopies()  # colocated: where the rank's storages wait during a rollout

    # ----------------------------------------------------------------------------------------------

    @property
    def module(self):
        return self.model.module if self.optimizer is not None else self.model

    def _uniform_microbatches(self) -> bool:
        # the allgather dispatcher gathers equal-sized token blocks across the expert group
        return self.config.moe_token_dispatcher_type == "allgather" \
            and self.ps.get_expert_model_parallel_world_size() > 1

    def _token_multiple(self) -> int:
        sp = self.ps.get_tensor_model_parallel_world_size() if self.config.sequence_parallel else 1
        return token_multiple(sp, self.cp, FP8_ALIGN[self.spec.fp8])

    def _packs(self) -> bool:
        """Microbatches run packed (THD): trainer.pack_sequences, where the layout allows it (not under
        context parallelism, whose rows are split into CP chunks, nor with uniform microbatches)."""
        return self.optim_spec.pack_sequences and not self._uniform_microbatches() and self.cp == 1

    def _packing(self, mb: Batch) -> Packing | None:
        """The microbatch's packing, computed once (forward and loss both need it; it reads lengths)."""
        if not self._packs():
            return None
        if id(mb) not in self._packings:
            self._packings[id(mb)] = Packing.of(mb.lengths_B, mb.input_ids_BS.shape[1],
                                                self._token_multiple())
        return self._packings[id(mb)]

    def _forward(self, mb: Batch, model) -> torch.Tensor:
        ps, pk = self.ps, self._packing(mb)
        ids, lengths = mb.input_ids_BS, mb.lengths_B
        routes = None if mb.routes_BSLK is None else mb.routes_BSLK.long()  # widened one microbatch at a time
        if routes is not None and (pk is not None or self.cp > 1):
            # names the sample, not the shard
            replay.check_complete(routes, lengths, self.config.num_moe_experts)
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        if pk is not None:  # the model sees one packed row; outputs are unpacked in _outputs
            ids, lengths, pos = pk.pack(ids), torch.tensor([pk.real], device=ids.device), pk.positions()
            routes = None if routes is None else pk.pack(routes, fill=-1)
        elif self.cp > 1:  # this CP rank's two chunks of every row; outputs are gathered in _outputs
            idx = local_positions(ids.shape[1], self.cp, ps.get_context_parallel_rank(), ids.device)
            routes = None if routes is None else replay.fill_padding(routes, lengths)[:, idx]
            ids, pos, lengths = ids[:, idx], pos[:, idx], torch.full_like(lengths, len(idx))
        if self._recording is not None:
            replay.record(self.replay_instances)
        elif self.spec.routing_replay:
            replay.set_targets(self.replay_instances, routes, lengths,
                               ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                               self.config.sequence_parallel, self.moe_layer_ids, self.config.moe_router_topk,
                               self.config.num_moe_experts)
        with hidden_out(self.module, self._chunked):
            out = model(ids, pos, None, **({} if pk is None else {"packed_seq_params": pk.seq_params()}))
        if self._recording is not None:
            rec = replay.recorded_routes(
                self.replay_instances, ids.shape[0], ids.shape[1], ps.get_tensor_model_parallel_rank(),
                ps.get_tensor_model_parallel_world_size(), self.config.sequence_parallel,
                ps.get_tensor_model_parallel_group())
            if pk is not None:
                rec = pk.unpack(rec)
            elif self.cp > 1:
                rec = gather_sequence(rec, 1, ps.get_context_parallel_group())
            self._recording.append(rec)
        return out

    @property
    def _chunked(self) -> bool:
        """The policy's log-probs come from its last hidden states a chunk of tokens at a time
        (trainer.logit_chunk_tokens), on the last pipeline stage."""
        return self.role != "critic" and bool(self.optim_spec.logit_chunk_tokens) \
            and self.ps.is_pipeline_last_stage()

    def _token_logprobs(self, output: torch.Tensor, targets_BS: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """log pi(targets) and the entropy, [b, s] each, from the last stage's output: its logits
        [b, s, V/tp], or (_chunked) its hidden states [b, s, h], through the output layer a chunk at a
        time."""
        ps = self.ps
        tp = (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(),
              ps.get_tensor_model_parallel_world_size())
        if not self._chunked:
            return target_logprobs(output, targets_BS, *tp)
        B, S = targets_BS.shape
        hidden = output.reshape(B * S, output.shape[-1])  # [B S, h]; B S may be 0 (an empty shard)
        logp, ent = chunked_target_logprobs(hidden, output_weight(self.module), targets_BS.reshape(-1),
                                            self.optim_spec.logit_chunk_tokens, *tp)
        return logp.view(B, S), ent.view(B, S)

    def _outputs(self, mb: Batch, output: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token model outputs [b, s] for microbatch `mb` from the last stage's output."""
        ps, pk = self.ps, self._packing(mb)
        if self.role == "critic":
            values = output.squeeze(-1).float()
            if self.cp > 1:
                values = gather_sequence(values, 1, ps.get_context_parallel_group())
            return {"critic_out_BS": values if pk is None else pk.unpack(values)}
        if self._chunked:
            output = last_hidden(output, self.module.output_layer.sequence_parallel,
                                 self.ps.get_tensor_model_parallel_group())
        if self.cp > 1:  # local logits score the next token of each local position; gather, then align
            ids = mb.input_ids_BS
            idx = local_positions(ids.shape[1], self.cp, ps.get_context_parallel_rank(), ids.device)
            next_ids = torch.nn.functional.pad(ids[:, 1:], (0, 1))
            logp, ent = self._token_logprobs(output, next_ids[:, idx])
            logp, ent = (gather_sequence(x, 1, ps.get_context_parallel_group()) for x in (logp, ent))
            return {"logp_BS": torch.nn.functional.pad(logp[:, :-1], (1, 0)),
                    "entropy_BS": torch.nn.functional.pad(ent[:, :-1], (1, 0))}
        ids = mb.input_ids_BS if pk is None else pk.pack(mb.input_ids_BS)
        # the output at t scores token t + 1; position 0 has no prediction
        logp, ent = (torch.nn.functional.pad(x, (1, 0))
                     for x in self._token_logprobs(output[:, :-1], ids[:, 1:]))
        if pk is not None:  # each row's first token has no prediction (packed, it would see the previous row)
            logp, ent = (torch.nn.functional.pad(pk.unpack(x)[:, 1:], (1, 0)) for x in (logp, ent))
        return {"logp_BS": logp, "entropy_BS": ent}

    def _run(self, microbatches: list[Batch], forward_only: bool, loss_func=None):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fb = get_forward_backward_func()
        self._packings = {}  # per call: keyed by the microbatches of this call, alive until it returns

        outputs = cpu_compat.natively(self._outputs)

        def step(data_iterator, model):
            mb = next(data_iterator)
            with cpu_compat.native_torch():
                out = self._forward(mb, model)
            if loss_func is not None:
                return out, cpu_compat.natively(partial(loss_func, mb))
            return out, lambda o, non_loss_data=False: outputs(mb, o)

        S = max(int(mb.input_ids_BS.shape[1]) for mb in microbatches)
        B = max(int(mb.input_ids_BS.shape[0]) for mb in microbatches)
        return fb(
            forward_step_func=step, data_iterator=iter(microbatches), model=[self.model],
            num_microbatches=len(microbatches), seq_length=S, micro_batch_size=B, forward_only=forward_only,
            collect_non_loss_data=forward_only and loss_func is None,
        )

    def _microbatches(self, batch: Batch) -> list[Batch]:
        multiple = self._token_multiple()
        if self._uniform_microbatches():
            # give every data-parallel rank the same microbatch count and shape (unpacked)
            shape = torch.tensor([batch.input_ids_BS.shape[0], int(batch.lengths_B.max())], dtype=torch.long,
                                 device=self.device)  # NCCL reduces device tensors only
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.ps.get_data_parallel_group())
            rows, length = int(shape[0]), -(-int(shape[1]) // multiple) * multiple
            per_mb = max(1, min(rows, self.optim_spec.micro_batch_tokens // length))
            return batch.uniform_microbatches(per_mb, -(-rows // per_mb), length)
        mbs = batch.microbatches(self.optim_spec.micro_batch_tokens, multiple, self._packs())
        if self.ps.get_expert_model_parallel_world_size() > 1:
            # every forward runs the experts' all-to-all over the expert group, whose ranks hold other
            # data-parallel shards: each must run as many microbatches (an empty one computes nothing)
            count = torch.tensor([len(mbs)], dtype=torch.long, device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.ps.get_data_parallel_group())
            empty = batch.rows(slice(0, 0), multiple).padded(1, multiple)
            mbs += [empty] * (int(count) - len(mbs))
        return mbs

    @torch.no_grad()
    def score(self, batch: Batch, record_routes: bool = False, adapters: bool = True) -> ScoreResult:
        """Forward only: logp_BS and entropy_BS (policy) or critic_out_BS (critic), [B, S], on every rank.

        batch.routes_BSLK, when given, is replayed. With record_routes=True the routers choose freely and
        the result also holds routes_BSLK: [B, S, L, K] (uint8 / int16, as rollout routes), the trainer's own
        top-k for every position. adapters=False: a LoRA policy scores as its frozen base.
        """
        self._resident()
        self.module.eval()
        mbs = [mb.to(self.device) for mb in self._microbatches(batch)]  # split on the host, then moved
        self._recording = [] if record_routes else None
        try:
            with contextlib.nullcontext() if adapters else lora.adapters_off(self.module):
                results = self._run(mbs, forward_only=True)
            recorded = self._recording
        finally:
            self._recording = None
            replay.clear(self.replay_instances)
        B, S = batch.input_ids_BS.shape
        out = ScoreResult(**self._whole(mbs, results, B, S))
        if record_routes:
            out.routes_BSLK = self._gather_stage_routes(recorded, mbs, B, S)
        return out

    def _whole(self, mbs: list[Batch], results: list[dict[str, torch.Tensor]], B: int,
               S: int) -> dict[str, torch.Tensor]:
        """The microbatches' per-token outputs (last stage) as [B, S] float32 tensors, on every stage."""
        out = {}
        if self.ps.is_pipeline_last_stage():
            for name in results[0]:
                full = torch.zeros(B, S, dtype=torch.float32)
                row = 0
                for mb, res in zip(mbs, results, strict=True):
                    # a microbatch may be padded past S (a multiple of tp) and past B (uniform microbatches)
                    b = min(mb.input_ids_BS.shape[0], B - row)
                    s = min(mb.input_ids_BS.shape[1], S)
                    full[row:row + b, :s] = res[name][:b, :s].detach().float().cpu()
                    row += b
                out[name] = full
        return self._broadcast_from_last_stage(out)

    def _gather_stage_routes(self, recorded: list[torch.Tensor], mbs: list[Batch], B: int,
                             S: int) -> torch.Tensor:
        K = self.config.moe_router_topk
        mine = torch.zeros(B, S, len(self.replay_instances), K,
                           dtype=route_torch_dtype(self.config.num_moe_experts))
        row = 0
        for mb, r in zip(mbs, recorded, strict=True):
            b = min(mb.input_ids_BS.shape[0], B - row)
            s = min(r.shape[1], S)
            mine[row:row + b, :s] = r[:b, :s].cpu()
            row += b
        if self.ps.get_pipeline_model_parallel_world_size() == 1:
            return mine
        parts = [None] * self.ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(parts, (self.moe_layer_ids, mine),
                               group=self.ps.get_pipeline_model_parallel_group())
        L = sum(len(ids) for ids, _ in parts)
        full = torch.zeros(B, S, L, K, dtype=mine.dtype)
        for ids, t in parts:
            full[:, :, ids] = t
        return full

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next updates: `lr` times each parameter group's lr_mult (trainer.lr_mult
        or critic.lr_mult; 1 elsewhere)."""
        self.lr = lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def offload(self, extra: list[torch.Tensor] = ()) -> int:
        """Hand this rank's parameters, gradient buffers and optimizer state (and `extra` tensors, e.g.
        the EWMA anchor) to host memory, colocated engines using the device meanwhile, until `onload`;
        returns the bytes moved."""
        return self._host.offload(storages(self.model, self.optimizer, extra))

    def onload(self) -> None:
        if self._host.offloaded:  # resident already (e.g. a resumed run's first step trains a kept rollout)
            self._host.restore()

    @property
    def offloaded(self) -> bool:
        return self._host.offloaded

    def _resident(self) -> None:
        if self._host.offloaded:
            raise RuntimeError("this rank's weights are in host memory (offloaded for a rollout): onload "
                               "first")

    def local_params(self) -> dict[str, torch.Tensor]:
        """This rank's trained parameter shards by name (for the PPO-EWMA anchor; with LoRA, the
        adapters)."""
        return {n: p.detach() for n, p in self.module.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def score_with(self, params: dict[str, torch.Tensor], batch: Batch) -> ScoreResult:
        """Score with other weights (e.g. the EWMA anchor) swapped in, then restore the current ones."""
        current = {n: p.detach().clone() for n, p in self.module.named_parameters()}
        named = dict(self.module.named_parameters())
        try:
            for n, v in params.items():
                named[n].copy_(v.to(named[n].dtype))
            return self.score(batch)
        finally:
            for n, v in current.items():
                named[n].copy_(v)

    def _broadcast_from_last_stage(self, out: dict) -> dict:
        if self.ps.get_pipeline_model_parallel_world_size() == 1:
            return out
        box = [out]
        last = self.ps.get_pipeline_model_parallel_last_rank()
        dist.broadcast_object_list(box, src=last, group=self.ps.get_pipeline_model_parallel_group())
        return box[0]

    def train_step(self, batch: Batch, loss_fn: Callable, denominator: torch.Tensor | dict[str, torch.Tensor],
                   keep_logp: bool = False) -> UpdateResult:
        """One optimizer update on this shard.

        loss_fn(outputs: dict of [b, s] tensors, mb: Batch) -> (numerator, metrics dict)
        denominator: the global denominator of the whole minibatch (all microbatches, all DP ranks).
        A loss of several terms with their own denominators (e.g. an importance-weighted policy term
        and an unweighted KL term) passes `denominator` as {term: tensor} and returns its numerator
        as {term: 0-dim tensor}: the loss is sum_k numerator_k / denominator_k.
        keep_logp: the result also holds logp_BS, the forward's log-probs before the update, [B, S]
        (as `score` returns them), on every rank.
        """
        if self.optimizer is None:
            raise RuntimeError(f"this {self.role} model only scores (built with trains=False)")
        self._resident()
        self.module.train()
        cpu_mbs = self._microbatches(batch)
        mbs = [mb.to(self.device) for mb in cpu_mbs]  # split on the host (no device sync per row), then moved
        has_tokens = {id(mb): int(c.lengths_B.sum()) > 0 for mb, c in zip(mbs, cpu_mbs, strict=True)}
        # megatron divides by the microbatch count and averages over DP; under CP it also multiplies by
        # cp (it expects CP-local losses) while our CP ranks each compute the whole loss: cancel that too
        scale = len(mbs) * self.ps.get_data_parallel_world_size() / self.cp
        microbatch_metrics: list[dict[str, torch.Tensor]] = []
        kept: list[dict[str, torch.Tensor]] = []  # keep_logp: each microbatch's, in order

        def loss_func(mb, output_tensor):
            outputs = self._outputs(mb, output_tensor)
            if keep_logp:
                kept.append({"logp_BS": outputs["logp_BS"].detach()})
            numerator, metrics = loss_fn(outputs, mb)
            if has_tokens[id(mb)]:  # an empty microbatch (padding for the expert group) has no figures
                microbatch_metrics.append({k: v.detach().float() for k, v in metrics.items()})
            if isinstance(numerator, dict):
                loss = sum(num / denominator[k].to(num.dtype) for k, num in numerator.items())
            else:
                loss = numerator / denominator.to(numerator.dtype)
            return loss * scale, {"loss": loss.detach()}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        # megatron's gradient finalisation updates routers' expert biases in place (DeepSeek-V3-style
        # aux-free balancing): kept aside, so a skipped step leaves them as they were
        biases = [(b, b.detach().clone()) for n, b in self.module.named_buffers()
                  if n.endswith("expert_bias")]
        try:
            losses = self._run(mbs, forward_only=False, loss_func=loss_func)
        finally:
            replay.clear(self.replay_instances)
        finite = self._finite(losses)
        if finite:
            ok, grad_norm, _ = self.optimizer.step()
        else:  # a NaN / inf loss or gradient on any rank: no rank of this model updates; weights untouched
            ok, grad_norm = False, float("nan")
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            for b, before in biases:
                b.copy_(before)
        self.steps += 1
        metrics = reduce_updates(microbatch_metrics)
        if self.ps.is_pipeline_last_stage():
            metrics["loss"] = float(sum(float(x["loss"]) for x in losses))
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_ok"] = float(bool(ok))
        metrics["skipped_nonfinite"] = float(not finite)
        metrics["lr"] = self.lr  # what the update used (times trainer.lr_mult's factors)
        metrics |= replay.router_losses(len(mbs))
        logp = self._whole(cpu_mbs, kept, *batch.input_ids_BS.shape)["logp_BS"] if keep_logp else None
        return UpdateResult(metrics, logp)

    def _finite(self, losses: list[dict]) -> bool:
        """Whether the loss (last pipeline stage) and every gradient on every rank of this model are
        finite: each rank checks its own (under the distributed optimizer its gradient buffers' unreduced
        part too, where its own NaN stays), then one all-reduce over the model's ranks (the process group
        they were started in). A loss term of detached inputs can be NaN with finite gradients."""
        # sums on the device (a NaN or inf anywhere makes its sum one), one host sync after the all-reduce
        sums = [b.grad_data.sum(dtype=torch.float32)
                for b in [*self.model.buffers, *self.model.expert_parallel_buffers]]
        sums += [x["loss"].float().sum() for x in losses if "loss" in x]
        bad = (~torch.isfinite(torch.stack(sums))).any().float().reshape(1) if sums \
            else torch.zeros(1, device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

