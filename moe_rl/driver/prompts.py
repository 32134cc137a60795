"""The run's prompts: the training stream (a dataset's rows, or prompts the environment generates) and the
held-out prompts, read and checked before anything starts (driver/preflight.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_rl.config import RunConfig

if TYPE_CHECKING:
    from moe_rl.rollout.envs import EnvSpec


def dataset_rows(cfg: RunConfig, path: str) -> list[dict]:
    """A JSONL or Parquet file's rows, each checked for what the run's environment reads (its required
    fields and `check_row`): DatasetError naming the file, line and field otherwise."""
    from moe_rl.rollout.data import load_prompts
    from moe_rl.rollout.envs import get_env

    env_cls = get_env(cfg.environment.name)
    return load_prompts(path, env_cls.required_fields, env_cls.check_row, cfg.environment.dataset_fields)


def generated_prompts(env: EnvSpec, n: int, seed: int) -> list[dict]:
    """n prompts the environment makes itself, from `seed`."""
    return env.env_cls.generate_prompts(n, seed=seed, options=env.built_options())


def training_prompts(cfg: RunConfig, env: EnvSpec) -> list[dict]:
    """The prompt stream: environment.dataset's rows, or prompts the environment (`env`) generates."""
    dataset = cfg.environment.dataset
    return dataset_rows(cfg, dataset) if dataset else generated_prompts(env, 100_000, cfg.run.seed)


def evaluation_prompts(cfg: RunConfig, env: EnvSpec) -> list[dict]:
    """The held-out prompts (trainer.eval_prompts of them): trainer.eval_dataset's first rows, or
    prompts the environment makes from a seed the training stream never uses."""
    tr = cfg.trainer
    if not tr.eval_prompts:
        return []
    if tr.eval_dataset:
        from moe_rl.rollout.data import DatasetError

        rows = dataset_rows(cfg, tr.eval_dataset)
        if len(rows) < tr.eval_prompts:
            raise DatasetError(f"trainer.eval_prompts={tr.eval_prompts}, but {tr.eval_dataset} has "
                               f"{len(rows)} rows")
        return rows[:tr.eval_prompts]
    return generated_prompts(env, tr.eval_prompts, cfg.run.seed + 424242)
