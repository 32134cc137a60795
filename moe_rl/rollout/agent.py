"""The agent loop: multi-turn episodes against an environment, token-in / token-out.

    agent = Agent(engine, tokenizer, EnvSpec("guess_number", {"low": 1, "high": 9}),
                  specs.agent_spec(cfg))
    trajectories = await agent.run_groups(prompts, samples_per_prompt=4)

One episode: the chat template is applied once to the environment's opening messages; each model turn
is sampled by the engine from the exact token prefix (the model's own tokens are never decoded and
re-encoded); the decoded text of the turn goes to the environment; its observation is tokenised as the
next chat message plus the assistant header and appended with response mask 0. The episode ends when
the environment says so (completed), the environment's `max_tool_errors` steps report a failed tool
call (tool_error), the token budget or context limit is reached (truncated_budget / truncated_context,
bootstrapped from the boundary state), the turns run out (truncated_turns, bootstrapped too), the model
repeats itself (repetition: a failed end, not bootstrapped), or the environment fails (env_error;
counted, not trained on). A machine that cannot run the tool sandbox (SandboxUnavailable) is no
episode's outcome: it stops the rollout.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field

from moe_rl.rollout.chat import ChatTokens
from moe_rl.rollout.engine import Sampling
from moe_rl.rollout.envs import EnvSpec, error_text
from moe_rl.rollout.record import TokenRecord
from moe_rl.rollout.sandbox import SandboxUnavailable
from moe_rl.rollout.seeds import sample_seed
from moe_rl.trajectory import Outcome, Trajectory, validate_trajectory

log = logging.getLogger(__name__)


def end_of_turn_id(tokenizer) -> int:
    """The token that ends a model turn: ChatML's <|im_end|> where the vocabulary has it, else EOS."""
    return tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() \
        else tokenizer.eos_token_id


@dataclass(frozen=True)
class AgentSpec:
    """Built from the config by moe_rl.driver.specs.agent_spec (defaults live in the config sections,
    config/run.py and config/learning.py)."""

    max_turns: int  # environment.max_turns
    token_budget: int  # environment.token_budget: model + observation tokens after the prompt; no turn
    # starts past it (the observation that ends the last turn is still appended as the boundary state)
    max_model_len: int  # rollout.max_model_len: the engine's context limit
    max_tokens_per_turn: int  # rollout.max_new_tokens
    temperature: float  # rollout.*
    top_p: float  # rollout.*
    overlong_filter: bool  # environment.*; DAPO: truncated episodes stay in the batch without policy loss
    repetition_limit: int = 3  # no config field: identical consecutive turns that end the episode
    env_timeout_s: float = 30.0  # no config field: a reset/step slower than this is an environment failure


@dataclass
class RolloutStats:
    outcomes: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)  # reason -> count
    dropped_groups: int = 0  # DAPO dynamic sampling: groups whose rewards were all equal
    overlong_filtered: int = 0
    tool_errors: int = 0
    # the engine process's (metrics.process_memory), after the rollout
    memory: dict = field(default_factory=dict)
    # the first environment failure (an env_error episode) of these episodes: "reset|step: Type: message
    # (file:line)"
    first_error: str = ""
    counts: Counter = field(default_factory=Counter)  # named counts, logged as rollout/NAME (the gateway's)


class Agent:
    def __init__(self, engine, tokenizer, env: EnvSpec, settings: AgentSpec,
                 gateway_host: str = "127.0.0.1"):
        """`gateway_host`: where the gateway serves (environment.name gateway: rollout/gateway.py)."""
        self.engine, self.tok, self.env, self.s = engine, tokenizer, env, settings
        self.gateway_host = gateway_host
        self.shared: dict = {}  # what copies of this agent share (RolloutActor.collect): the gateway
        self.env_options = env.built_options()  # checked once; every episode's environment shares them
        env.env_cls.check_context(env.context)  # e.g. the reward function imports here too: fails at start
        self.eos = end_of_turn_id(tokenizer)
        self.chat = ChatTokens(tokenizer, self.eos)
        self.stats = RolloutStats()
        # a template that cannot render turns fails here
        self.chat.after_turn_text([{"role": env.env_cls.role_for_observations, "content": ""}])

    # -- tokenisation of non-model content ------------------------------------------------------

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.chat.prompt_ids(messages)

    def _observation_ids(self, role: str, text: str, closed: bool) -> list[int]:
        """Tokens after a model turn: the end of the turn, the observation message and the next assistant
        header (rollout/chat.py)."""
        return self.chat.after_turn_ids([{"role": role, "content": text}], closed)

    # -- one episode ----------------------------------------------------------------------------

    async def run_harness_episode(self, row: dict, group_id: int = 0, sample_index: int = 0,
                                  seed: int | None = None) -> list[Trajectory]:
        """An episode a harness of the user's runs through the gateway (started on first use): its
        trajectories, one per prefix break plus one, or one env_error."""
        trajectories, failure, counts = await (await self.gateway()).run_episode(row, group_id, sample_index,
                                                                                 seed)
        self.stats.counts.update(counts)
        return [self._failed(row, group_id, sample_index, failure)] if failure else trajectories

    async def gateway(self):
        """The gateway of this engine process, started on first use and shared by this agent's copies."""
        if "gateway" not in self.shared:  # the first episode starts it; the others wait for the start
            from moe_rl.rollout.envs.harness import harness_function
            from moe_rl.rollout.gateway import Gateway, GatewayOptions

            o = self.env_options
            options = GatewayOptions(harness_function(o.harness), o.max_concurrent, o.episode_timeout_s,
                                     o.max_request_bytes, o.tool_parser)
            gateway = Gateway(self.engine, self.chat, self.tok, self.eos, self.s, options, self.gateway_host)
            self.shared["gateway"] = asyncio.ensure_future(gateway.start())
        await self.shared["gateway"]
        return self.shared["gateway"].result()

    async def run_episode(self, prompt: dict, group_id: int = 0, sample_index: int = 0,
                          seed: int | None = None) -> Trajectory:
        s = self.s
        env = self.env.make(self.env_options)
        try:
            messages = await asyncio.wait_for(env.reset(prompt), s.env_timeout_s)
        except SandboxUnavailable:
            raise  # the machine's failure, not the episode's: the run stops
        except Exception as err:
            return self._failed(prompt, group_id, sample_index, f"reset: {error_text(err)}")
        rec = TokenRecord.of_prompt(self._prompt_ids(messages))
        turn_rewards: list[float] = []
        terminal, outcome, version, figures = 0.0, None, None, {}
        last_texts: list[str] = []
        tool_errors = 0
        for turn in range(s.max_turns):
            budget_left = s.token_budget - (len(rec.ids) - rec.prompt_len)
            context_left = s.max_model_len - len(rec.ids)
            if budget_left <= 0:
                outcome = Outcome.TRUNCATED_BUDGET
                break
            if context_left <= 1:
                outcome = Outcome.TRUNCATED_CONTEXT
                break
            sampling = Sampling(max_tokens=min(s.max_tokens_per_turn, budget_left, context_left - 1),
                                temperature=s.temperature, top_p=s.top_p, stop_token_ids=(self.eos,),
                                seed=None if seed is None else sample_seed(seed, "turn", turn),
                                routes_from=0 if rec.routes is None else rec.routes.num_positions)
            res = await self.engine.agenerate(rec.ids, sampling)
            version = res.weight_version if version is None else version
            if not rec.add_turn(res, self.eos):
                outcome = Outcome.TRUNCATED_CONTEXT
                break
            text = self.tok.decode(res.token_ids, skip_special_tokens=True)
            try:
                step = await asyncio.wait_for(env.step(text), s.env_timeout_s)
            except SandboxUnavailable:
                raise  # never an observation or a counted env_error: the run stops
            except Exception as err:
                turn_rewards.append(0.0)
                outcome = Outcome.ENV_ERROR
                self._env_error(f"step: {error_text(err)}")
                break
            turn_rewards.append(float(step.reward))
            tool_errors += int(step.tool_error)
            if step.info:  # the episode's figures: what its last step reported (done, or before a truncation)
                # bools: 0/1
                figures = {k: float(v) for k, v in step.info.items() if isinstance(v, (int, float))}
            too_many = step.tool_error and env.max_tool_errors is not None \
                and tool_errors >= env.max_tool_errors
            # too many failed tool calls: the framework ends it, for every environment
            if step.done or too_many:
                terminal = float(step.final_reward or 0.0)
                outcome = Outcome.TOOL_ERROR if step.tool_error else Outcome.COMPLETED
                break
            last_texts = (last_texts + [text])[-s.repetition_limit:]
            if len(last_texts) == s.repetition_limit and len(set(last_texts)) == 1:
                outcome = Outcome.REPETITION
                break
            if step.observation is not None:
                obs = self._observation_ids(env.role_for_observations, step.observation, rec.closed)
                if len(rec.ids) + len(obs) > s.max_model_len:
                    outcome = Outcome.TRUNCATED_CONTEXT  # the observation does not fit: boundary lacks it
                    break
                rec.observe(obs)
        if outcome is None:
            outcome = Outcome.TRUNCATED_TURNS  # out of turns: the task could go on
        self.stats.tool_errors += tool_errors
        if version is None:
            version = getattr(self.engine, "version", 0)
        return Trajectory(
            token_ids=rec.ids, response_mask=rec.mask, logprobs=rec.logps, spans=rec.spans,
            turn_rewards=turn_rewards, terminal_reward=terminal, outcome=outcome, boundary_len=len(rec.ids),
            weight_version=version, prompt_len=rec.prompt_len, routes=rec.routes, group_id=group_id,
            sample_index=sample_index,
            info={"tool_errors": tool_errors, "turns": len(rec.spans), "figures": figures},
            versions=rec.all_versions(version))

    def _env_error(self, reason: str) -> None:
        """An episode the environment failed (env_error): logged, each one; the first kept for the stop
        line."""
        log.warning("environment failed (env_error): %s", reason)
        self.stats.first_error = self.stats.first_error or reason

    def _failed(self, prompt, group_id, sample_index, reason) -> Trajectory:
        self._env_error(reason)
        return Trajectory([0], [False], [0.0], [], [], 0.0, Outcome.ENV_ERROR, 1, 0, 1, None, group_id,
                          sample_index, {"error": reason})

    # -- many episodes ----------------------------------------------------------------------------

    def accept(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """Validate each trajectory against the checklist; count and drop the invalid ones."""
        kept = []
        for t in trajectories:
            self.stats.outcomes[t.outcome.value] += 1
            if t.outcome is Outcome.ENV_ERROR:
                self.stats.rejected["env_error"] += 1
                continue
            problems = validate_trajectory(t, self.s.max_model_len)
            if problems:
                for p in problems:
                    self.stats.rejected[p.split(":")[0]] += 1
                log.warning("rejected trajectory (group %d sample %d): %s", t.group_id, t.sample_index,
                            "; ".join(problems))
                continue
            kept.append(t)
        return kept

    async def run_groups(self, prompts: list[dict], samples_per_prompt: int, seed: int | None = None,
                         first_group_id: int = 0) -> list[list[Trajectory]]:
        """n samples per prompt, all conversations in flight together. Returns validated groups."""
        episode = self.run_harness_episode if self.env.env_cls.drives_itself else self.run_episode
        tasks = [episode(p, first_group_id + g, k,
                         None if seed is None else sample_seed(seed, "sample", first_group_id + g, k))
                 for g, p in enumerate(prompts) for k in range(samples_per_prompt)]
        done = [t for ts in await asyncio.gather(*tasks) for t in (ts if isinstance(ts, list) else [ts])]
        for t in done:  # a dataset row's `teacher` field: the distillation teacher of its episodes
            teacher = prompts[t.group_id - first_group_id].get("teacher")
            if teacher:  # absent or null: the default teacher (teacher.path)
                t.info["teacher"] = str(teacher)
        if "gateway" in self.shared:
            self.stats.counts.update((await self.gateway()).drain_counts())
        kept = self.accept(done)
        if self.s.overlong_filter:
            self.overlong_filter(kept)
        groups: dict[int, list[Trajectory]] = {}
        for t in kept:
            groups.setdefault(t.group_id, []).append(t)
        return [groups[g] for g in sorted(groups)]

    async def dynamic_sampling(self, next_prompts, groups_wanted: int, samples_per_prompt: int,
                               max_rounds: int, seed: int | None = None,
                               first_group_id: int = 0) -> list[list[Trajectory]]:
        """DAPO dynamic sampling: drop groups whose rewards are all equal (no learning signal) and keep
        sampling fresh prompts, at most max_rounds rounds. `next_prompts(k)` returns k new prompts."""
        kept: list[list[Trajectory]] = []
        gid = first_group_id
        for round_ in range(max_rounds + 1):
            need = groups_wanted - len(kept)
            if need <= 0:
                break
            prompts = next_prompts(need)
            for group in await self.run_groups(prompts, samples_per_prompt,
                                               None if seed is None else sample_seed(seed, "round", round_),
                                               gid):
                rewards = {round(t.total_reward, 9) for t in group}
                if len(group) > 1 and len(rewards) == 1:
                    self.stats.dropped_groups += 1
                else:
                    kept.append(group)
            gid += len(prompts)
        return kept[:groups_wanted]

    def overlong_filter(self, trajectories: list[Trajectory]) -> None:
        """DAPO overlong filtering: samples cut off by a length limit (the token budget or the context)
        stay in the batch but get no policy loss. Running out of turns is not a length cut."""
        for t in trajectories:
            if t.outcome in (Outcome.TRUNCATED_BUDGET, Outcome.TRUNCATED_CONTEXT):
                t.info["loss_excluded"] = "overlong"
                self.stats.overlong_filtered += 1
