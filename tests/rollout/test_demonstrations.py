"""The supervised warm start's episodes (Rollouts.demonstrations): played by the environment's scripted
expert, or by the reference policy trainer.warm_start_policy names. The guessing game's expert guesses at
random in range; its "binary search" opens every game with 5 and wins each within 4 guesses. The
demonstrations run in the driver's process through the agent loop; no engine is involved, so the Rollouts
here is made without starting any (`object.__new__`)."""

import re

from conftest import agent_spec

from moe_rl.config import from_dict
from moe_rl.driver import specs
from moe_rl.driver.rollout_manager import Rollouts
from moe_rl.tiny import build_tokenizer


def demo_games(tmp_path, policy: str) -> list[list[str]]:
    cfg = from_dict({"environment": {"name": "guess_number"}, "rollout": {"max_new_tokens": 4},
                     "trainer": {"warm_start_steps": 2, "warm_start_policy": policy}})
    tok = build_tokenizer(tmp_path)
    rollouts = object.__new__(Rollouts)
    rollouts.cfg, rollouts.model_path, rollouts.env = cfg, str(tmp_path), specs.env_spec(cfg)
    rollouts.agent_spec = agent_spec(max_turns=4, token_budget=160, max_tokens_per_turn=4)
    batches = rollouts.demonstrations(2, 8, cfg.trainer.warm_start_policy)
    assert [b.input_ids_BS.shape[0] for b in batches] == [8, 8]
    return [re.findall(r"assistant\n(\d+)<\|im_end\|>", tok.decode(row[:length]))
            for b in batches for row, length in zip(b.input_ids_BS, b.lengths_B, strict=True)]


def test_the_warm_start_plays_the_named_reference_policy(tmp_path):
    searched = demo_games(tmp_path, "binary search")
    assert all(game[0] == "5" and 1 <= len(game) <= 4 for game in searched)
    assert all(len(set(game)) == len(game) for game in searched)  # nothing guessed twice
    expert = demo_games(tmp_path, "")
    assert {game[0] for game in expert} != {"5"}
