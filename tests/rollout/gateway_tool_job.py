"""A tool-calling harness through the gateway on the real engine: the tiny model is first taught (a few
hundred supervised steps with transformers, on CPU) to answer one prompt with a Hermes-style tool call,
so that vLLM's `hermes` tool parser has a real call to read from the model's sampled text."""

import json

import torch
from conftest import agent_spec, engine_spec

PROMPT = "What is a tiger? Use the lookup tool."
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "tiger"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                            "parameters": {"type": "object",
                                                           "properties": {"q": {"type": "string"}}}}}]


def teach_the_call(model_path, out_dir, steps=300):
    """The tiny model, trained to answer PROMPT (with TOOLS) with CALL and <|im_end|>; saved to out_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tools=TOOLS, tokenize=False,
                                     add_generation_prompt=True)
    p_ids = tok.encode(prompt, add_special_tokens=False)
    t_ids = tok.encode(CALL, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    ids = torch.tensor([p_ids + t_ids])
    labels = torch.tensor([[-100] * len(p_ids) + t_ids])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return float(loss)


def gateway_tool_job(rank, world, model_path, out_dir):
    import asyncio
    from pathlib import Path

    from transformers import AutoTokenizer

    from moe_rl.rollout.agent import Agent
    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.rollout.envs import EnvSpec, import_object

    final_loss = teach_the_call(model_path, out_dir)
    engine = RolloutEngine(engine_spec(out_dir, max_model_len=256, seed=0))
    tok = AutoTokenizer.from_pretrained(out_dir)
    path = Path(__file__).with_name("harnesses.py")
    options = {"harness": f"{path}:tool_calling", "tool_parser": "hermes"}
    agent = Agent(engine, tok, EnvSpec("gateway", options),
                  agent_spec(token_budget=200, max_tokens_per_turn=96))
    rows = [{"id": f"tool-{i}", "prompt": PROMPT, "tools": TOOLS, "stream": i % 2 == 1} for i in range(4)]

    async def go():
        groups = await agent.run_groups(rows, samples_per_prompt=1, seed=2)
        await (await agent.gateway()).close()
        return [t for g in groups for t in g]

    trajs = asyncio.run(go())
    seen = import_object(f"{path}:SEEN")
    return {"trajs": trajs, "stats": agent.stats, "seen": {r["id"]: seen.get(r["id"]) for r in rows},
            "final_loss": final_loss, "call_ids": tok.encode(CALL, add_special_tokens=False),
            "tool_result": json.dumps({"q": "tiger"})}
