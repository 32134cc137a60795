"""How tests run `moe-rl`: the small settings of test_loop's runs, the CLI as a process of its own
(`run_cli`, as a user runs it), the CLI's main in the test process (`run_main`), and `moe-rl train` there
on one local Ray kept for the module (`run_train`)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

SMALL = ["run.steps=3", "checkpoint.every=1", "trainer.warm_start_steps=2", "trainer.warm_start_batch=4",
         "trainer.eval_prompts=0", "trainer.eval_every=0",
         "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
         "logging.progress_bar=false", "cluster.num_cpus=2", "logging.routing_diagnostics_every=3",
         "logging.heatmap_every=3",
         # the policy's learning rate decays linearly to 0 at run.steps: each step has its own (the fault
         # tests' resumed runs take the schedule up where it was)
         "trainer.lr_schedule=linear"]


# switches turned off from the quickstart: the settings only they read go back to their defaults (a
# setting that nothing reads is refused)
NO_CRITIC = ["algorithm.advantage=grpo", "critic.lr=1e-5", "critic.value_clip=0.2"]
NO_WARM_START = ["trainer.warm_start_steps=0", "trainer.warm_start_lr=1e-3", "trainer.warm_start_batch=16"]


def train_args(out: Path, *extra: str) -> list[str]:
    """`moe-rl train`'s arguments for the quickstart with the small settings."""
    return ["configs/quickstart.yaml", f"run.output_dir={out}", *SMALL, *extra]


def train_cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moe_rl.cli", "train", *train_args(out, *extra)]


def run_cli(out: Path, *extra: str, expect: int = 0, timeout=900):
    """`moe-rl train` as a user runs it: a process of its own, with its own local Ray."""
    proc = subprocess.run(train_cmd(out, *extra), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def run_main(*args: str, expect: int | None = None) -> subprocess.CompletedProcess:
    """`moe-rl ARGS` as the CLI's main in this process, from the repository root: what it printed and its
    exit code (argparse's exit 2 included), asserted to be `expect` when given. Spares a test the
    interpreter and imports of a process of its own where the subject is what main does."""
    import contextlib
    import io

    from moe_rl import cli
    from moe_rl.driver import session

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT):
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                try:
                    rc = cli.main(list(args))
                except SystemExit as stop:  # argparse's usage errors
                    rc = stop.code if isinstance(stop.code, int) else 1
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
            session.INTERRUPTED.clear()
    proc = subprocess.CompletedProcess(list(args), rc, stdout.getvalue(), stderr.getvalue())
    assert expect is None or rc == expect, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def train_on_kept_ray(*args: str, expect: int | None = None) -> subprocess.CompletedProcess:
    """`moe-rl train ARGS` (run_main) on one local Ray kept for the test module (conftest stops it after
    the module) and set up as a run's own (session.runtime_env from the repository root, the 2 CPUs of
    cluster.num_cpus=2): a run pays no interpreter, Ray start or driver imports of its own."""
    import contextlib

    import ray

    from moe_rl.driver import session

    if not ray.is_initialized():
        with contextlib.chdir(ROOT):
            ray.init(num_cpus=2, include_dashboard=False, runtime_env=session.runtime_env(),
                     log_to_driver=False)
    return run_main("train", *args, expect=expect)


def run_train(out: Path, *extra: str, expect: int = 0) -> subprocess.CompletedProcess:
    """The quickstart with the small settings on the kept Ray."""
    return train_on_kept_ray(*train_args(out, *extra), expect=expect)


# The driver's order in test_loop's small runs (SMALL: 3 steps, a checkpoint after each, no evaluation), as
# timeline.json records it (`schedule_order`): the real runs and tests/test_schedule.py's in-process
# schedule over recorders must both match these.
SMALL_ORDER = {
    "sync": ["offload 0", "generate 0", "wait 0", "onload 0", "update 0", "save 1",
             "offload 1", "generate 1", "wait 1", "onload 1", "update 1", "save 2",
             "offload 2", "generate 2", "wait 2", "onload 2", "update 2", "save 3"],
    # the next rollout is submitted before the step trains; a checkpoint finishes it first and holds it
    "async": ["offload 0", "generate 0", "wait 0", "onload 0", "generate 1", "update 0", "finish 1", "save 1",
              "wait 1", "onload 1", "generate 2", "update 1", "finish 2", "save 2",
              "wait 2", "onload 2", "update 2", "save 3"],
    # resumed from the step-2 checkpoint of "async": step 2 trains on the rollout it held
    "async resumed at 2": ["wait 2", "onload 2", "update 2", "save 3"],
    # rollout.async_depth=2: two rollouts run ahead of the trainer, the step-1 checkpoint holds both
    "async depth 2": ["offload 0", "generate 0", "wait 0", "onload 0", "generate 1", "generate 2",
                      "update 0", "finish 1", "finish 2", "save 1", "wait 1", "onload 1", "update 1",
                      "finish 2", "save 2", "wait 2", "onload 2", "update 2", "save 3"],
    # resumed from its step-1 checkpoint: steps 1 and 2 train on the two rollouts it held
    "async depth 2 resumed at 1": ["wait 1", "onload 1", "update 1", "finish 2", "save 2",
                                   "wait 2", "onload 2", "update 2", "save 3"],
}
ORDER_EVENTS = ("offload", "evaluate", "generate", "wait", "finish", "onload", "update", "save")


def schedule_order(names: list[str]) -> list[str]:
    """A timeline's events ("name step", in order) that say when rollouts, updates, evaluations and
    checkpoints happened (ORDER_EVENTS), without the update's parts and the step spans."""
    return [n for n in names if n.split()[0] in ORDER_EVENTS]


def timeline_names(out: Path) -> list[str]:
    """The driver's events in a run directory's timeline.json, by their start: "name step"."""
    import json

    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    driver = sorted((e for e in events if e["tid"] == 0 and e["ph"] in "XiB"), key=lambda e: e["ts"])
    return [f"{e['name']} {e['args']['step']}" if "step" in e["args"] else e["name"] for e in driver]
