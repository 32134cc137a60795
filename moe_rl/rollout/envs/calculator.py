"""Arithmetic with a calculator tool: tool call -> tool result observation -> verified final answer.

The model may call the tool any number of times, `<calc>12*7+3</calc>`, and sees `<result>87</result>`
(or `<result>tool_error: ...</result>`) as the next observation; it finishes with `<answer>87</answer>`.
Reward 1.0 for a correct final answer. The expression is evaluated in the sandbox (a subprocess with
CPU, memory and time limits and no network) by a restricted evaluator (numbers and + - * / // % **
with bounded exponents only) — a timeout, crash or bad expression becomes a tool_error observation (the
agent loop ends the episode after `max_tool_errors` of them). A machine that cannot run the sandbox is
not the model's error: the config is refused when it loads, and `SandboxUnavailable` stops a run.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from moe_rl.rollout.envs import Environment, StepResult, register_env
from moe_rl.rollout.sandbox import run_python

_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_RESULT = re.compile(r"<result>(-?\d+)</result>")
_QUESTION = re.compile(r"What is ([0-9*+ ]+)\?")

_EVALUATOR = r"""
import ast, sys
ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
       ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
       ast.Pow: lambda a, b: a ** b if abs(b) <= 64 else 1 / 0}
def ev(n):
    if isinstance(n, ast.Expression): return ev(n.body)
    if isinstance(n, ast.Constant) and type(n.value) in (int, float): return n.value
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
        v = ev(n.operand); return -v if isinstance(n.op, ast.USub) else v
    if isinstance(n, ast.BinOp) and type(n.op) in ops: return ops[type(n.op)](ev(n.left), ev(n.right))
    raise ValueError("only numbers and + - * / // % ** are allowed")
v = ev(ast.parse(sys.stdin.read(), mode="eval"))
print(int(v) if float(v).is_integer() else round(v, 6))
"""


@register_env("calculator")
class Calculator(Environment):
    @dataclass(frozen=True)
    class Options:
        # generated prompts compute a*b+c with integers in [2, max_operand]; the tool's time limit is
        # environment.tool_timeout_s (self.context.tool_timeout_s)
        max_operand: int = 99

        def check(self) -> None:
            if self.max_operand < 2:
                raise ValueError(f"max_operand={self.max_operand} must be >= 2")

    required_fields = ("question", "answer")
    sandboxed_tools = True
    reads_tool_timeout = True

    async def reset(self, prompt: dict) -> list[dict]:
        self.answer = int(prompt["answer"])
        self.timeout = self.context.tool_timeout_s
        return [{"role": "system",
                 "content": "Use <calc>expr</calc> to compute, then reply <answer>n</answer>."},
                {"role": "user", "content": str(prompt["question"])}]

    async def step(self, action_text: str) -> StepResult:
        final = _ANSWER.search(action_text)
        if final:
            return StepResult(None, done=True,
                              final_reward=1.0 if int(final.group(1)) == self.answer else 0.0)
        call = _CALL.search(action_text)
        if not call:
            return StepResult("Reply with <calc>expr</calc> or <answer>n</answer>.", reward=-0.05)
        result = await self.calculate(call.group(1))
        return StepResult(f"<result>{result}</result>", tool_error=result.startswith("tool_error"))

    async def calculate(self, expression: str) -> str:
        """The tool's answer to the model's expression, or `tool_error: why` (the model's call failed).
        SandboxUnavailable (stops the run) and a tool that does not start at all (OSError: the episode's
        env_error) are raised: the machine failed, not the model's call."""
        res = await run_python(_EVALUATOR, stdin=expression[:200], timeout_s=self.timeout,
                               cpu_s=max(1, int(self.timeout)))
        if not res.ok:
            last = res.stderr.strip().splitlines()[-1:] or [res.reason]
            return f"tool_error: {res.reason or 'failed'}: {last[0][:120]}"
        return res.stdout.strip()

    @classmethod
    def expert_turn(cls, conversation: str, rng) -> str:
        """Calls the tool on the question's expression, then answers with the tool's result (a
        format expert whose answers are right: the tool does the arithmetic)."""
        results = _RESULT.findall(conversation)
        if results:
            return f"<answer>{results[-1]}</answer>"
        return f"<calc>{_QUESTION.findall(conversation)[-1]}</calc>"

    @classmethod
    def generate_prompts(cls, n: int, seed: int, options: Options) -> list[dict]:
        max_operand = options.max_operand
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            a, b, c = (rng.randint(2, max_operand) for _ in range(3))
            out.append({"question": f"What is {a}*{b}+{c}?", "answer": a * b + c})
        return out
