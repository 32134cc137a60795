"""Metrics: TensorBoard scalars (namespaced rollout/, reward/, policy/, critic/, correction/, routing/,
timing/, perf/, memory/) and a console progress bar with ETA.

A step's figures come from the rollout manager (rollout/, staleness), the update loops (policy/,
critic/, correction/ of the updates), the route traffic (driver/trainer_groups.py Models.route_figures) and
`step_figures`, what the batch, the scores and the targets say (reward/, routing/, the log-prob
mismatch); they meet in `StepLog.step`.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch


def scalar(v) -> float | None:
    if isinstance(v, torch.Tensor):
        v = v.detach().float()
        if v.numel() != 1:
            return None
        v = v.item()
    try:
        return float(v)  # NaN and inf are kept: a diverging run must show it
    except (TypeError, ValueError):
        return None


def process_memory() -> dict[str, float]:
    """This process's resident memory and, with CUDA, its GPU memory allocated now and at peak, in GiB
    (`memory_*_max` keys: merged over ranks and updates by their maximum)."""
    out = {"memory_rss_gib_max": psutil.Process().memory_info().rss / 2**30}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out |= {"memory_gpu_allocated_gib_max": torch.cuda.memory_allocated() / 2**30,
                "memory_gpu_peak_gib_max": torch.cuda.max_memory_allocated() / 2**30}
    return out


def role_figures(role: str, updates: list[dict[str, object]]) -> dict[str, float]:
    """`reduce_updates` under the role's prefix (policy/loss, ...); its ranks' memory as memory/ROLE_*."""
    return {f"memory/{role}_{k.removeprefix('memory_')}" if k.startswith("memory_") else f"{role}/{k}": v
            for k, v in reduce_updates(updates).items()}


def reduce_updates(updates: list[dict[str, object]]) -> dict[str, float]:
    """One step's figures from its updates (every minibatch of every epoch): the mean of each key,
    except max-like keys (`*_max`, `*max`) take the maximum and min-like keys (`*_min`) the minimum.
    Keys missing from some updates are reduced over the updates that have them. A non-finite value
    is kept (a NaN loss in one update makes the step's NaN), never averaged away."""
    seen: dict[str, list[float]] = {}
    for u in updates:
        for k, v in u.items():
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                seen.setdefault(k, []).append(float(v))
    out = {}
    for k, vs in seen.items():
        if k.endswith("max"):
            out[k] = max(vs)
        elif k.endswith("min"):
            out[k] = min(vs)
        else:
            out[k] = sum(vs) / len(vs)
    return out


class Metrics:
    """Scalars, histograms, heatmaps and texts to each of `writers` (moe_rl.trackers; None: TensorBoard
    under `log_dir`, or nothing where not `enabled`), written every `every` steps (and at the last step),
    and a progress bar advanced every step."""

    def __init__(self, log_dir: str | Path | None = None, enabled: bool = True, total_steps: int = 0,
                 progress: bool = True, every: int = 1, heatmap_every: int = 0, writers: list | None = None):
        from moe_rl.trackers import TensorBoardWriter

        if writers is None:
            writers = [TensorBoardWriter(log_dir)] if enabled and log_dir is not None else []
        self.writers = writers
        self.every, self.total, self.heatmap_every = every, total_steps, heatmap_every
        self.bar, self.progress = None, progress  # the bar starts after the first step: its one-time costs
        # (engine warm-up, first compilations) stay out of the rate and the time left

    def log(self, step: int, values: dict[str, object], advance: bool = True) -> dict[str, float]:
        """Scalars (returned), plus `hist/TAG` values as histograms and `heatmap/TAG/PANEL` [L, E] expert
        loads as one labelled image per TAG, its panels side by side (plots.expert_load_image; every
        `heatmap_every` steps), to each writer."""
        clean, extra = {}, {}
        for k, v in values.items():
            if k.startswith(("hist/", "heatmap/")):
                extra[k] = v
            elif (f := scalar(v)) is not None:
                clean[k] = f
        clean["memory/rss_gib"] = psutil.Process().memory_info().rss / 2**30
        if self.writers and (step % self.every == 0 or step == self.total or not advance):
            heatmaps: dict[str, dict[str, torch.Tensor]] = {}
            hists = {}
            for k, v in extra.items():
                if k.startswith("hist/") and v.numel():
                    hists[k.removeprefix("hist/")] = v
                elif k.startswith("heatmap/") and self.heatmap_every and step % self.heatmap_every == 0:
                    tag, _, panel = k.removeprefix("heatmap/").rpartition("/")
                    heatmaps.setdefault(tag, {})[panel] = v
            if heatmaps:
                from moe_rl.plots import expert_load_image
            images = {tag: expert_load_image({p: v.numpy() for p, v in panels.items()})
                      for tag, panels in heatmaps.items()}
            for w in self.writers:
                w.scalars(clean, step)
                for tag, v in hists.items():
                    w.histogram(tag, v, step)
                for tag, image in images.items():
                    w.image(tag, image, step)
                w.flush()
        if self.progress and advance:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, initial=step, desc="RL steps", unit="step",
                                dynamic_ncols=True)
            else:
                self.bar.update(1)
            if step >= self.total:  # the last step: what follows (evaluation, saving) is not a step
                self.bar.close()
            self.bar.set_postfix(progress_figures(clean))
        return clean

    def text(self, tag: str, text: str, step: int = 0) -> None:
        for w in self.writers:
            w.text(tag, text, step)
            w.flush()

    def close(self) -> None:
        for w in self.writers:
            w.close()
        self.writers = []
        if self.bar is not None:
            self.bar.close()


def progress_figures(figures: dict[str, float]) -> dict[str, str]:
    """What the progress bar shows of a step: the reward, the mean episode length, the step's time and,
    where the environment reports a success figure (env/success), the success rate."""
    out = {"reward": f"{figures.get('reward/mean', float('nan')):.3f}",
           "len": f"{figures.get('rollout/length_mean', float('nan')):.0f}"}
    if "timing/step_s" in figures:
        out["step"] = f"{figures['timing/step_s']:.1f}s"
    if "env/success" in figures:
        out["success"] = f"{figures['env/success']:.0%}"
    return out


def expert_load_figures(name: str, load_LE: torch.Tensor, title: str) -> dict[str, object]:
    """Expert-load figures of one routing (algos.stats.expert_load's [L, E] shares): the load imbalance
    (max / mean) and usage entropy (over log E) per layer and summarised, and the shares themselves as a
    panel titled `title` of the moe/expert_load heatmap (rows: layers, columns: experts)."""
    from moe_rl.algos import stats

    imbalance, entropy = stats.load_imbalance(load_LE), stats.usage_entropy(load_LE)
    return {f"moe/{name}_load_imbalance_max": imbalance.max(),
            f"moe/{name}_load_imbalance_mean": imbalance.mean(),
            f"moe/{name}_usage_entropy_min": entropy.min(),
            **{f"moe/{name}_layer{i:02d}_load_imbalance": x for i, x in enumerate(imbalance)},
            **{f"moe/{name}_layer{i:02d}_usage_entropy": x for i, x in enumerate(entropy)},
            f"heatmap/moe/expert_load/{title}": load_LE}


def token_version_figures(trajectories: list, current: int) -> dict[str, float]:
    """Per-token weight versions of a step's model tokens against the engines' `current` version: the
    share of trajectories whose tokens come from several versions (a sync landed mid-conversation), and
    the age (current - version) of the tokens: mean, max, and the share sampled by the current weights."""
    ages, spanning = [], 0
    for t in trajectories:
        versions = t.versions or [t.weight_version] * len(t.token_ids)
        mine = [v for v, m in zip(versions, t.response_mask, strict=True) if m]
        spanning += len(set(mine)) > 1
        ages += [current - v for v in mine]
    return {"rollout/spanning_versions_frac": spanning / max(1, len(trajectories)),
            "rollout/token_age_mean": sum(ages) / max(1, len(ages)),
            "rollout/token_age_max": max(ages, default=0),
            "rollout/token_age_0_frac": sum(a == 0 for a in ages) / max(1, len(ages))}


def evaluation_figures(trajectories: list, prompts: int, samples: int) -> dict[str, float]:
    """eval/ figures of `samples` samples for each of `prompts` held-out prompts (group g, sample k):
    the mean reward of the scored samples, the success rate over all of them (mean@samples; a sample
    lost to an environment error counts as a failure, eval/rejected counts them) and pass@k for k = 1,
    2, 4, ... up to `samples` (and `samples` itself). An episode a gateway harness split at prefix breaks
    (several trajectories of one group and sample, one reward) counts once."""
    from moe_rl.algos.stats import pass_at_k
    from moe_rl.trajectory import trajectory_success

    success = torch.zeros(prompts, samples, dtype=torch.bool)
    episodes = {(t.group_id, t.sample_index): t for t in trajectories}
    for (g, k), t in episodes.items():
        success[g, k] = trajectory_success(t)
    rewards = torch.tensor([t.total_reward for t in episodes.values()], dtype=torch.float64)
    ks = sorted({k for k in (2 ** i for i in range(samples.bit_length())) if k <= samples} | {samples})
    return {"eval/reward_mean": float(rewards.mean()) if len(rewards) else float("nan"),
            "eval/success_rate": float(success.double().mean()),
            f"eval/mean@{samples}": float(success.double().mean()),
            **{f"eval/pass@{k}": float(pass_at_k(success, k)) for k in ks}, "eval/samples": len(episodes),
            "eval/prompts": prompts, "eval/rejected": prompts * samples - len(episodes)}


def step_figures(batch, scores, targets, num_experts: int = 0) -> dict[str, object]:
    """The figures of a step's batch (moe_rl.batch.Batch), scores and targets (algos.targets); with the
    model's `num_experts`, the expert load of the rollout's routes (and of the trainer's own routing on
    steps with the free-routing diagnostic)."""
    from moe_rl.algos import stats
    from moe_rl.algos.rewards import last_action_index

    valid = batch.mask_BS
    n_tok = valid.sum().clamp(min=1)

    def gap(logp):  # |log pi - log mu| on model tokens, 0 elsewhere
        return (logp - batch.logp_mu_BS).abs() * valid

    replayed = gap(scores.logp_BS)
    out = {
        "reward/mean": batch.score_B.mean(), "reward/max": batch.score_B.max(),
        "reward/min": batch.score_B.min(), "reward/success_rate": batch.success_B.float().mean(),
        "rollout/length_mean": batch.lengths_B.float().mean(),
        "rollout/model_tokens_mean": valid.sum(1).float().mean(),
        "rollout/turns_mean": batch.turns_B.float().mean(),
        "policy/advantage_mean": (targets.adv_BS * valid).sum() / n_tok,
        "correction/logp_mismatch_mean": replayed.sum() / n_tok,
        "correction/logp_mismatch_max": replayed.max(), **targets.metrics,
    }
    if scores.logp_teacher_BS is not None:
        out["timing/teacher_score_s"] = scores.teacher_seconds
    if scores.free_logp_BS is not None:
        out["correction/logp_mismatch_no_replay"] = gap(scores.free_logp_BS).sum() / n_tok
    if scores.free_routes_BSLK is not None:
        # positions that influence a sampled token: everything before each sample's last model token
        S = batch.input_ids_BS.shape[1]
        attn = torch.arange(S).expand_as(valid) < last_action_index(valid).unsqueeze(1)
        # [B, S, L]
        same = (scores.free_routes_BSLK.sort(-1).values == batch.routes_BSLK.sort(-1).values).all(-1)
        out["routing/agreement"] = ((same & attn.unsqueeze(-1)).sum()
                                    / (attn.sum() * same.shape[-1]).clamp(min=1))
    if targets.returns_BS is not None:
        out["critic/explained_variance"] = stats.explained_variance(targets.values_old_BS, targets.returns_BS,
                                                                    valid)
    if batch.routes_BSLK is not None:
        out["routing/filled_tail_positions_per_sample"] = \
            (batch.lengths_B - batch.routed_len_B).float().mean()
    # the positions the engine computed (placeholders excluded)
    if num_experts and batch.routes_BSLK is not None:
        computed = torch.arange(batch.input_ids_BS.shape[1]) < batch.routed_len_B.unsqueeze(1)
        out.update(expert_load_figures("rollout", stats.expert_load(batch.routes_BSLK, computed, num_experts),
                                       "rollout (vLLM)"))
        if scores.free_routes_BSLK is not None:  # the trainer's own choices at the same positions
            free = stats.expert_load(scores.free_routes_BSLK, computed, num_experts)
            out.update(expert_load_figures("trainer_free", free, "trainer (free routing)"))
    out.update({"hist/rollout/model_tokens": valid.sum(1), "hist/rollout/length": batch.lengths_B,
                "hist/reward/score": batch.score_B, "hist/policy/advantage": targets.adv_BS[valid]})
    return out


class Timeline:
    """What the driver did, in order, with its wall-clock times: spans (`span`: an offload, a wait for a
    rollout, a step's update, a checkpoint) and instants (`mark`: a rollout submitted to the engines), each
    with the step it belongs to. `names()` is the order ("wait 2", ...); `write` saves it as a Chrome trace
    (timeline.json: open it in https://ui.perfetto.dev or chrome://tracing), the driver on one track and
    each rollout, from its submission to its batch in hand, on another."""

    def __init__(self):
        self.t0 = time.perf_counter()
        # [name, step, start, end]: end is the start for an instant, None for a span not ended; by start
        self.events: list[list] = []

    @contextmanager
    def span(self, name: str, step: int | None = None):
        event = [name, step, time.perf_counter(), None]
        self.events.append(event)
        try:
            yield
        finally:
            event[3] = time.perf_counter()

    def mark(self, name: str, step: int | None = None) -> None:
        t = time.perf_counter()
        self.events.append([name, step, t, t])

    def names(self) -> list[str]:
        """The events by their start, each as "name" or "name step"."""
        return [name if step is None else f"{name} {step}" for name, step, _, _ in self.events]

    def write(self, path: Path) -> Path:
        def us(t: float) -> float:
            return round((t - self.t0) * 1e6, 1)

        trace = []
        for name, step, start, end in self.events:  # a span not ended (the run stopped in it): "B", open
            ph = "B" if end is None else "i" if end == start else "X"
            trace.append({"name": name, "ph": ph, "ts": us(start), "pid": 0, "tid": 0,
                          "args": {} if step is None else {"step": step},
                          **({"dur": us(end) - us(start)} if ph == "X" else {})})
        submitted = {step: start for name, step, start, _ in self.events if name == "generate"}
        for name, step, _, end in self.events:  # each rollout: submitted -> its batch in hand
            if name == "wait" and step in submitted and end is not None:
                trace.append({"name": f"rollout {step}", "ph": "X", "ts": us(submitted[step]), "pid": 0,
                              "tid": 1, "dur": us(end) - us(submitted[step]), "args": {"step": step}})
        trace += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": label}}
                  for tid, label in ((0, "driver"), (1, "rollouts"))]
        path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
        return path


class StepLog:
    """A run's metrics: timers, one merged dict per step, the trackers and the progress bar, history; the
    driver's timeline."""

    def __init__(self, log_dir: str | Path | None, enabled: bool, total_steps: int, progress: bool,
                 every: int, heatmap_every: int = 0, writers: list | None = None):
        self.metrics = Metrics(log_dir, enabled, total_steps, progress, every, heatmap_every, writers)
        self.history: list[dict[str, float]] = []
        self.timings: dict[str, float] = {}
        self.timeline = Timeline()

    @contextmanager
    def timer(self, name: str, step: int | None = None):
        """Times the block as timing/{name}_s (logged with the next step) and a span of the timeline."""
        t = time.perf_counter()
        try:
            with self.timeline.span(name, step):
                yield
        finally:
            self.timings[f"timing/{name}_s"] = time.perf_counter() - t

    def add(self, figures: dict) -> None:
        """Figures measured between two steps (e.g. the swap before a rollout): logged with the next."""
        self.timings.update(figures)

    def step(self, step: int, *parts: dict) -> dict[str, float]:
        """Log step `step` from its figures (later parts win on a shared key) and the timers run since
        the last step (timing/step_s: the step's timer)."""
        out = {k: v for part in parts for k, v in part.items()}
        out.update(self.timings)
        if "timing/step_s" in out:
            out["timing/train_step_s"] = out["timing/step_s"] - out.get("timing/generate_wait_s", 0.0)
        self.history.append(self.metrics.log(step, out))
        self.timings = {}
        return self.history[-1]

    def close(self) -> None:
        self.metrics.close()
