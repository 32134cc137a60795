"""The tokens of one trajectory as its episode is played: the one place a model turn's and an
observation's tokens are appended, for the agent loop (rollout/agent.py) and the gateway's episodes
(rollout/gateway.py) alike.

    rec = TokenRecord.of_prompt(prompt_ids)
    rec.add_turn(result, eos)   # the engine's tokens: the model's (mask), log-probs, versions, routes
    rec.observe(observation)    # tokens the model did not sample
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenRecord:
    """ids: every token so far; mask: which the model sampled; logps: their behaviour log-probs (0 on
    the others); versions: the weight version of each position the engine has computed (the prompt and
    observations by the turn that read them first, sampled tokens by their own); spans: (first, last)
    position of each model turn; routes: the experts the engine chose at the positions it computed;
    closed: the last model turn ended with the end-of-turn token."""

    ids: list[int]
    prompt_len: int
    mask: list[bool] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    routes: object = None
    closed: bool = True

    @classmethod
    def of_prompt(cls, ids: list[int], **kw) -> TokenRecord:
        ids = list(ids)
        return cls(ids, len(ids), [False] * len(ids), [0.0] * len(ids), **kw)

    def observe(self, ids: list[int]) -> None:
        """Tokens the model did not sample (an observation, a tool result, the next user message)."""
        self.ids += ids
        self.mask += [False] * len(ids)
        self.logps += [0.0] * len(ids)

    def add_turn(self, res, eos: int) -> bool:
        """The engine's result (rollout.engine's GenerateResult) for the tokens so far: its versions of
        the positions it computed, its routes merged, its sampled tokens appended as the model's, a span.
        False, and no span, when it sampled nothing."""
        start = len(self.ids)
        self.versions += [res.weight_version] * (start - len(self.versions))  # the positions it computed
        self.versions += res.token_versions()
        self.routes = res.routes if self.routes is None or res.routes is None \
            else self.routes.extended(res.routes)
        self.ids += res.token_ids
        self.mask += [True] * len(res.token_ids)
        self.logps += res.logprobs
        if not res.token_ids:
            return False
        self.spans.append((start, len(self.ids) - 1))
        self.closed = res.token_ids[-1] == eos
        return True

    def all_versions(self, default: int) -> list[int]:
        """A version for every position: one the engine never computed (a last observation) takes the
        last computed one's, or `default` when nothing was computed."""
        return self.versions + [self.versions[-1] if self.versions else default] * (len(self.ids)
                                                                                   - len(self.versions))
