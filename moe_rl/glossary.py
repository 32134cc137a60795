"""The metric glossary: every scalar a run logs (to TensorBoard and the other trackers), with its meaning
and unit, written next to one another here and read from here by `moe-rl metrics docs` (docs/metrics.md;
a test keeps it current) and by the tests, which check that every tag a real run logged is described.

A tag is written out (`policy/loss`) or, for a family whose members depend on the run, as a pattern with
`{placeholders}` (`env/{key}`, `moe/{routing}_layer{layer}_load_imbalance`); PLACEHOLDERS says what each
one stands for and which names it matches.

    describe("policy/loss")        # its Entry; None for a tag the glossary does not know
    undescribed(["policy/loss", "policy/made_up"])  # ["policy/made_up"]
    markdown()                     # docs/metrics.md

Adding a figure to the code? Add its line here (the section of its prefix), then regenerate the page:
`moe-rl metrics docs > docs/metrics.md`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from moe_rl.trajectory import Outcome

# what a `{name}` in a pattern stands for: (the regular expression it matches, its description)
_CORRECTION_WEIGHTS = ("token_raw", "token_truncated", "token_post_rejection", "seq_raw", "seq_truncated")
_REJECT_REASONS = ("env_error", "empty", "length", "lengths", "action_mask", "spans", "boundary", "rewards",
                   "turn_rewards", "routes", "versions", "policy_roles")
PLACEHOLDERS: dict[str, tuple[str, str]] = {
    "key": (r"[^/]+", "a figure the environment reports of its episodes (the numbers in a step's `info`, or "
                      "a gateway harness's result): its name is the environment's, e.g. `env/success`"),
    "role": (r"[a-z][a-z0-9_]*", "a trainer role: `policy`, `critic`, `reference`, `reward_model` or a "
                                 "distillation teacher's slot (`teacher`, `teacher_<name>`)"),
    "routing": (r"rollout|trainer_free", "`rollout`: the routes the engines chose (vLLM) at the positions "
                                         "they computed; `trainer_free`: the trainer's own routing at the "
                                         "same positions (steps with the free-routing diagnostic)"),
    "layer": (r"\d{2}", "a MoE layer's index, two digits (`00`, `01`, ...)"),
    "n": (r"\d+", "the samples per held-out prompt (trainer.eval_samples)"),
    "k": (r"\d+", "1, 2, 4, ... up to the samples per held-out prompt, and that number itself"),
    "outcome": ("|".join(o.value for o in Outcome), "how an episode ended: " +
                ", ".join(f"`{o.value}`" for o in Outcome)),
    "reason": ("|".join(_REJECT_REASONS), "why a trajectory was refused: `env_error` (the environment "
               "failed) or the first word of the checklist's complaint (rollout.agent "
               "validate_trajectory): " + ", ".join(f"`{r}`" for r in _REJECT_REASONS[1:])),
    "weights": ("|".join(_CORRECTION_WEIGHTS), "which importance weights: " +
                ", ".join(f"`{w}`" for w in _CORRECTION_WEIGHTS)),
    "counter": (r"gateway_(?:requests|prefix_breaks|timeouts|harness_errors|unauthorized)",
                "an event the OpenAI-compatible gateway counts: `gateway_requests`, `gateway_prefix_breaks`, "
                "`gateway_timeouts`, `gateway_harness_errors`, `gateway_unauthorized`"),
}


@dataclass(frozen=True)
class Entry:
    tag: str  # a tag, or a pattern with {placeholders}
    unit: str
    meaning: str

    @property
    def section(self) -> str:
        return self.tag.split("/", 1)[0]

    def matches(self, tag: str) -> bool:
        return _regex(self.tag).fullmatch(tag) is not None


@cache
def _regex(pattern: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", pattern)
    return re.compile("".join(re.escape(p) if i % 2 == 0 else f"(?:{PLACEHOLDERS[p][0]})"
                              for i, p in enumerate(parts)))


def _e(tag: str, unit: str, meaning: str) -> Entry:
    return Entry(tag, unit, " ".join(meaning.split()))


# What each prefix is about, in the order the page shows them.
SECTIONS: dict[str, str] = {
    "reward": "What the step's episodes scored (after reward shaping).",
    "rollout": "The step's rollout: its episodes, what was refused, how old its tokens were.",
    "env": "What the environment reports of its episodes (means over the step's episodes).",
    "policy": "The policy's update: means over its minibatches and epochs (maxima for `*_max`, minima for "
              "`*_min`), unless said otherwise.",
    "critic": "The critic's (value model's) update, with a critic (algorithm.advantage: gae).",
    "correction": "Off-policy correction: the gap between the engine's and the trainer's log-probabilities, "
                  "the importance weights and the staleness of async rollouts.",
    "distill": "On-policy distillation: the reverse KL from the teacher on the step's model tokens.",
    "routing": "Rollout Routing Replay: the replayed routes and what they cost to send.",
    "moe": "Expert load: how evenly the routers spread the tokens over the experts.",
    "timing": "Wall-clock times of a step's phases.",
    "perf": "Throughput.",
    "memory": "Memory: the driver's, the engines' and each trainer role's ranks'.",
    "eval": "Held-out evaluation (trainer.eval_prompts), logged at step 0 and every "
            "trainer.eval_every steps.",
    "warm_start": "The supervised warm start before RL (trainer.warm_start_steps), logged once, at step 0.",
}

ENTRIES: tuple[Entry, ...] = (
    # reward/
    _e("reward/mean", "reward", "Mean episode score R(tau) of the step's trajectories, after shaping."),
    _e("reward/max", "reward", "Highest episode score of the step."),
    _e("reward/min", "reward", "Lowest episode score of the step."),
    _e("reward/success_rate", "fraction", "Share of the step's trajectories that succeeded (the "
       "environment's success flag)."),
    _e("reward/model_mean", "reward", "Mean score the reward model gave the step's trajectories."),
    _e("reward/model_std", "reward", "Standard deviation of the reward model's scores over the step."),
    _e("reward/kl_penalty_mean", "nats", "Mean per-token KL penalty to the reference policy folded into "
       "the reward (algorithm.kl_reward_coef), per model token."),
    _e("reward/overlong_penalty_mean", "reward", "Mean penalty for overlong responses (DAPO soft overlong "
       "punishment, algorithm.overlong_penalty) over the step's trajectories."),
    _e("reward/combined_mean", "reward", "Mean score after combining the environment's reward, the reward "
       "model's and the penalties."),
    # rollout/
    _e("rollout/samples", "trajectories", "Trajectories trained on this step (after refusals and dropping "
       "too-stale ones)."),
    _e("rollout/rejected", "trajectories", "Trajectories refused this step (environment errors and "
       "checklist failures), all reasons together."),
    _e("rollout/rejected_{reason}", "trajectories", "Trajectories refused this step for one reason."),
    _e("rollout/outcome_{outcome}", "fraction", "Share of the step's episodes that ended this way (0 when "
       "none did: every outcome is logged every step)."),
    _e("rollout/dropped_groups", "groups", "Prompt groups dropped this step by DAPO dynamic sampling: every "
       "sample of the group scored the same (no learning signal)."),
    _e("rollout/tool_errors", "calls", "Failed tool calls in the step's episodes."),
    _e("rollout/overlong_filtered", "trajectories", "Truncated trajectories masked out of the loss "
       "(environment.overlong_filter)."),
    _e("rollout/engine_restarts", "restarts", "Inference engines restarted so far in the run (cumulative)."),
    _e("rollout/length_mean", "tokens", "Mean trajectory length (prompt, responses and observations)."),
    _e("rollout/model_tokens_mean", "tokens", "Mean number of model-generated tokens per trajectory."),
    _e("rollout/turns_mean", "turns", "Mean number of turns per episode."),
    _e("rollout/spanning_versions_frac", "fraction", "Share of trajectories whose tokens were sampled by "
       "more than one weight version (async rollouts with in-flight weight updates)."),
    _e("rollout/token_age_mean", "versions", "Mean age of the model tokens: the engines' current weight "
       "version minus the version that sampled the token."),
    _e("rollout/token_age_max", "versions", "Largest age of a model token this step."),
    _e("rollout/token_age_0_frac", "fraction", "Share of the model tokens sampled by the current weights."),
    _e("rollout/{counter}", "count", "Gateway events this step (environments driven through the "
       "OpenAI-compatible gateway)."),
    # env/
    _e("env/{key}", "the environment's", "Mean of an environment-reported figure over the step's "
       "episodes. `env/success`, when reported, is also shown by the progress bar."),
    # policy/
    _e("policy/loss", "loss", "The policy loss of an update (summed over its microbatches)."),
    _e("policy/lr", "1/step", "Learning rate the optimizer used."),
    _e("policy/grad_norm", "L2 norm", "Gradient norm before clipping (NaN when it could not be computed)."),
    _e("policy/update_ok", "fraction", "Share of updates the optimizer applied (1: every one)."),
    _e("policy/skipped_nonfinite", "updates", "Updates skipped for a non-finite loss or gradient this step "
       "(a count)."),
    _e("policy/skipped_minibatches", "minibatches", "Minibatches not trained on this step: nothing left in "
       "the loss after masking (a count)."),
    _e("policy/advantage_mean", "advantage", "Mean advantage over the model tokens."),
    _e("policy/entropy", "nats", "Mean entropy of the policy's next-token distribution over the "
       "loss tokens."),
    _e("policy/kl_ref", "nats", "Mean KL estimate to the reference policy (the regularizer's, "
       "algorithm.kl_loss_coef) over the loss tokens."),
    _e("policy/approx_kl_k2", "nats", "KL(pi_old || pi_theta) estimate k2 = (log r)^2 / 2, mean "
       "over tokens."),
    _e("policy/approx_kl_k3", "nats", "KL(pi_old || pi_theta) estimate k3 = r - 1 - log r, mean "
       "over tokens."),
    _e("policy/ratio_mean", "ratio", "Mean importance ratio r = pi_theta / pi_old over the loss tokens."),
    _e("policy/ratio_max", "ratio", "Largest importance ratio."),
    _e("policy/ratio_min", "ratio", "Smallest importance ratio."),
    _e("policy/clipfrac", "fraction", "Share of tokens whose ratio was clipped (losses with one clip)."),
    _e("policy/clipfrac_low", "fraction", "Share of tokens clipped at 1 - clip_low (negative advantages)."),
    _e("policy/clipfrac_high", "fraction", "Share of tokens clipped at 1 + clip_high (positive advantages)."),
    _e("policy/clipfrac_dual", "fraction", "Share of tokens caught by dual clipping (algorithm.dual_clip)."),
    _e("policy/sapo_weight_mean", "ratio", "SAPO: the tokens' mean gradient weight 4 s (1 - s), s = "
       "sigmoid(tau (r - 1)), against the plain policy gradient's (1 on-policy; lower: the gate damps "
       "off-policy tokens)."),
    _e("policy/seq_clipfrac_low", "fraction", "Share of sequences clipped low (sequence-level ratio, GSPO)."),
    _e("policy/seq_clipfrac_high", "fraction", "Share of sequences clipped high (sequence-level "
       "ratio, GSPO)."),
    _e("policy/nll", "nats", "Mean negative log-likelihood of the target tokens (supervised updates)."),
    _e("policy/opsm_masked_frac", "fraction", "Share of sequences the OPSM policy mask left out."),
    _e("policy/opsm_masked_of_negative", "fraction", "Share of the negative-advantage sequences the OPSM "
       "mask left out."),
    _e("policy/m2po_m2_before", "nats^2", "M2PO: the mean second moment of the log-ratio before masking."),
    _e("policy/m2po_m2_after", "nats^2", "M2PO: the mean second moment of the log-ratio after masking."),
    _e("policy/m2po_masked_frac", "fraction", "M2PO: share of the tokens masked out."),
    _e("policy/anchor_logp_gap", "nats", "PPO-EWMA: mean |log pi_theta - log pi_anchor| between the policy "
       "and its EWMA anchor."),
    # critic/
    _e("critic/loss", "loss", "The value loss of an update."),
    _e("critic/lr", "1/step", "The critic's learning rate."),
    _e("critic/grad_norm", "L2 norm", "The critic's gradient norm before clipping."),
    _e("critic/update_ok", "fraction", "Share of the critic's updates the optimizer applied."),
    _e("critic/skipped_nonfinite", "updates", "Critic updates skipped for a non-finite loss or gradient "
       "(a count)."),
    _e("critic/value_mean", "return", "Mean predicted value over the model tokens."),
    _e("critic/value_clipfrac", "fraction", "Share of tokens whose value prediction was clipped."),
    _e("critic/explained_variance", "fraction", "1 - Var(returns - values) / Var(returns) of the old values: "
       "1 is a perfect critic, 0 no better than a constant, below 0 worse."),
    # correction/
    _e("correction/logp_mismatch_mean", "nats", "Mean |log pi_trainer - log mu_engine| over the model "
       "tokens, with the replayed routes: the training-inference mismatch."),
    _e("correction/logp_mismatch_max", "nats", "Largest per-token |log pi_trainer - log mu_engine|."),
    _e("correction/logp_mismatch_no_replay", "nats", "The same mean mismatch with the trainer routing freely "
       "(steps with the free-routing diagnostic): what Rollout Routing Replay saves."),
    _e("correction/staleness_mean", "versions", "Mean lag (trainer's version - the sampling version) of the "
       "step's samples."),
    _e("correction/staleness_max", "versions", "Largest lag of a sample this step."),
    _e("correction/stale_dropped", "trajectories", "Samples dropped for exceeding rollout.max_staleness."),
    _e("correction/ess_{weights}", "samples", "Effective sample size (sum w)^2 / sum w^2 of the importance "
       "weights."),
    _e("correction/ess_frac_{weights}", "fraction", "The effective sample size over the number of samples."),
    _e("correction/tis_truncated_frac", "fraction", "Truncated IS: share of tokens whose weight hit "
       "the cap."),
    _e("correction/seq_is_truncated_frac", "fraction", "Sequence IS: share of sequences whose weight hit the "
       "cap."),
    _e("correction/rejection_rate", "fraction", "Token rejection: share of tokens rejected by the mask."),
    _e("correction/geo_truncated_frac", "fraction", "Geometric-mean IS: share of sequences truncated at the "
       "cap."),
    _e("correction/geo_rejected_frac", "fraction", "Geometric-mean rejection: share of sequences rejected."),
    # distill/
    _e("distill/reverse_kl_mean", "nats", "Mean per-token reverse KL(student || teacher) estimate."),
    _e("distill/reverse_kl_p95", "nats", "95th percentile of the per-token reverse KL estimates."),
    # routing/
    _e("routing/agreement", "fraction", "Share of (position, layer) pairs where the trainer's free routing "
       "chose the engine's experts (free-routing diagnostic steps)."),
    _e("routing/filled_tail_positions_per_sample", "tokens", "Positions per sample whose routes the engine "
       "did not compute (the last token), filled by the trainer."),
    _e("routing/route_bytes_per_rank", "bytes", "Bytes of routes each policy rank received since the last "
       "step, scoring and training together."),
    _e("routing/route_bytes_per_rank_int64_computed", "bytes", "What the older path (int64 routes, every "
       "rank the whole batch for scoring) would have sent for the same calls: the baseline."),
    _e("routing/score_route_bytes_per_rank", "bytes", "Bytes of routes each policy rank received for the "
       "scoring passes."),
    _e("routing/score_route_bytes_per_rank_int64_computed", "bytes", "The older path's bytes for the "
       "scoring passes."),
    # moe/
    _e("moe/{routing}_load_imbalance_max", "ratio", "Largest per-layer load imbalance (max expert load / "
       "mean expert load; 1 is perfectly even)."),
    _e("moe/{routing}_load_imbalance_mean", "ratio", "Mean per-layer load imbalance."),
    _e("moe/{routing}_usage_entropy_min", "fraction", "Smallest per-layer usage entropy, over log(experts) "
       "(1: every expert equally used)."),
    _e("moe/{routing}_layer{layer}_load_imbalance", "ratio", "One layer's load imbalance."),
    _e("moe/{routing}_layer{layer}_usage_entropy", "fraction", "One layer's usage entropy over "
       "log(experts)."),
    # timing/
    _e("timing/step_s", "s", "Wall time of the step."),
    _e("timing/train_step_s", "s", "The step's time not spent waiting for the rollout (timing/step_s - "
       "timing/generate_wait_s)."),
    _e("timing/generate_wait_s", "s", "Time the driver waited for the step's rollout."),
    _e("timing/score_s", "s", "Scoring the batch (pi_old, reference, reward model, teachers)."),
    _e("timing/advantages_s", "s", "Computing the rewards, corrections and advantages."),
    _e("timing/actor_train_s", "s", "The policy's update (0 on a step it did not train)."),
    _e("timing/critic_train_s", "s", "The critic's update (0 without one)."),
    _e("timing/teacher_score_s", "s", "Scoring the batch with the distillation teachers."),
    _e("timing/sync_s", "s", "Syncing the new weights to the engines."),
    _e("timing/sync_export_s", "s", "Exporting the weights for the sync."),
    _e("timing/sync_load_s", "s", "The engines loading the synced weights."),
    _e("timing/offload_s", "s", "Offloading the trainer's device memory to the engines (cluster.offload)."),
    _e("timing/onload_s", "s", "Restoring the trainer's device memory (cluster.offload)."),
    _e("timing/round_trips", "calls", "The driver's waits on remote calls this step."),
    _e("timing/dp_imbalance", "ratio", "Max / mean of the policy's data-parallel replicas' "
       "estimated cost per "
       "call (parallel.dp > 1)."),
    _e("timing/dp_imbalance_measured", "ratio", "Max / mean of the replicas' measured wall time of the "
       "scoring passes."),
    # perf/
    _e("perf/generate_tokens_per_s", "tokens/s", "Model tokens generated per second of waiting for "
       "the rollout."),
    _e("perf/train_tokens_per_s", "tokens/s", "Tokens trained on (times the epochs) per second of update."),
    # memory/
    _e("memory/rss_gib", "GiB", "The driver process's resident memory."),
    _e("memory/offloaded_gib", "GiB", "Trainer device memory offloaded to make room for the engines."),
    _e("memory/engine_rss_gib_max", "GiB", "Resident memory of the largest inference engine."),
    _e("memory/engine_gpu_allocated_gib_max", "GiB", "GPU memory allocated by the largest engine."),
    _e("memory/engine_gpu_peak_gib_max", "GiB", "Peak GPU memory allocated by the largest engine."),
    _e("memory/{role}_rss_gib_max", "GiB", "Largest resident memory of the role's ranks."),
    _e("memory/{role}_gpu_allocated_gib_max", "GiB", "Largest GPU memory allocated by one of the "
       "role's ranks."),
    _e("memory/{role}_gpu_peak_gib_max", "GiB", "Largest peak GPU memory of one of the role's ranks."),
    # eval/
    _e("eval/reward_mean", "reward", "Mean reward of the held-out samples."),
    _e("eval/success_rate", "fraction", "Share of held-out samples that succeeded (an environment error "
       "counts as a failure)."),
    _e("eval/mean@{n}", "fraction", "The success rate over the n samples per prompt (= eval/success_rate)."),
    _e("eval/pass@{k}", "fraction", "Unbiased pass@k: the chance that at least one of k samples of a prompt "
       "succeeds, averaged over the prompts."),
    _e("eval/samples", "episodes", "Held-out episodes scored."),
    _e("eval/prompts", "prompts", "Held-out prompts."),
    _e("eval/rejected", "episodes", "Held-out samples lost to environment errors or refusals."),
    # warm_start/
    _e("warm_start/nll_first", "nats", "Mean negative log-likelihood of the first warm-start step."),
    _e("warm_start/nll_last", "nats", "Mean negative log-likelihood of the last warm-start step."),
    _e("warm_start/steps", "steps", "Warm-start steps taken."),
    _e("warm_start/lr", "1/step", "Learning rate of the warm start."),
)


def describe(tag: str) -> Entry | None:
    """The glossary's entry for a logged tag (its own or its family's); None when it has none."""
    return next((e for e in ENTRIES if e.matches(tag)), None)


def undescribed(tags) -> list[str]:
    """The tags the glossary does not describe, sorted."""
    return sorted(t for t in set(tags) if describe(t) is None)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/metrics.md: every prefix's tags, with their units and meanings, and the placeholders."""
    lines = ["# Every metric", "",
             "<!-- generated by `moe-rl metrics docs > docs/metrics.md` from moe_rl/glossary.py: "
             "edit that, not this -->", "",
             "Every scalar a run logs (to TensorBoard and the other trackers), by prefix, with its "
             "unit and meaning. A name in braces stands for a family of tags (the placeholders are listed at "
             "the end). Figures are of one step unless said otherwise; `moe-rl metrics docs` prints "
             "this page.",
             ""]
    assert {e.section for e in ENTRIES} <= set(SECTIONS), {e.section for e in ENTRIES} - set(SECTIONS)
    for section, about in SECTIONS.items():
        lines += [f"## {section}/", "", about, "", "| Tag | Unit | Meaning |", "| --- | --- | --- |"]
        lines += [f"| `{e.tag}` | {_cell(e.unit)} | {_cell(e.meaning)} |" for e in ENTRIES
                  if e.section == section]
        lines.append("")
    lines += ["## Placeholders", "", "| Placeholder | Stands for |", "| --- | --- |"]
    lines += [f"| `{{{name}}}` | {_cell(about)} |" for name, (_, about) in PLACEHOLDERS.items()]
    return "\n".join(lines) + "\n"


def command(action: str, tag: str | None) -> int:
    """`moe-rl metrics docs` (every metric as Markdown) and `moe-rl metrics explain TAG` (exit 2: unknown)."""
    import sys

    if action == "docs":
        print(markdown(), end="")
        return 0
    entry = describe(tag)
    if entry is None:
        print(f"moe-rl: {tag}: not a metric the glossary knows (moe-rl metrics docs lists them)",
              file=sys.stderr)
        return 2
    family = "" if entry.tag == tag else f" (of the family {entry.tag})"
    print(f"{tag}{family}: {entry.unit}\n  {entry.meaning}")
    return 0
