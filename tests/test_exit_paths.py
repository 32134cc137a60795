"""Every exit path of `moe-rl train` (done, an error, SIGINT, SIGTERM) leaves nothing of the run alive:
a census of the processes descended from the train process (the local Ray, its workers, the engines and
their children), taken while it runs; none of them is alive 5 s after it exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_runs import NO_CRITIC

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# the policy alone (GRPO): the exits of a run with a critic's ranks take the same paths (tests/test_loop.py)
MINIMAL = ["run.steps=1", "trainer.warm_start_steps=0", "trainer.warm_start_lr=1e-3",
           "trainer.eval_prompts=0", "trainer.eval_every=0",
           "logging.progress_bar=false", "cluster.num_cpus=2",
           "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", *NO_CRITIC]


class Run:
    """`moe-rl train` in its own session; its output read line by line, its descendants counted."""

    def __init__(self, out: Path, *extra: str, env: dict[str, str] | None = None):
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_rl.cli", "train", "configs/quickstart.yaml", f"run.output_dir={out}",
             *MINIMAL, *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True)
        self.lines: list[str] = []
        self.seen: dict[tuple[int, float], str] = {}  # (pid, create time) -> name: every descendant seen
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._census = threading.Thread(target=self._count, daemon=True)
        self._census.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def _count(self) -> None:
        try:
            root = psutil.Process(self.proc.pid)
        except psutil.Error:
            return
        while self.proc.poll() is None:
            try:
                for p in root.children(recursive=True):
                    try:
                        # the latest name: a Ray worker takes its actor's name (ray::RolloutActor) after it
                        # starts; an exiting process's command line reads empty, which keeps the last one
                        key, cmd = (p.pid, p.create_time()), " ".join(p.cmdline())[:120]
                        if cmd or key not in self.seen:
                            self.seen[key] = cmd or p.name()
                    except psutil.Error:
                        pass
            except psutil.Error:
                return
            time.sleep(0.2)

    def wait_for(self, text: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, f"exited before {text!r}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout} s:\n{self.output()}"
            time.sleep(0.05)

    def wait_seen(self, text: str, timeout: float = 300) -> None:
        """Until the census has seen a process whose name holds `text`."""
        deadline = time.monotonic() + timeout
        while not any(text in name for name in list(self.seen.values())):
            assert self.proc.poll() is None, f"exited before a {text!r} process:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {text!r} process in {timeout} s:\n{self.output()}"
            time.sleep(0.05)

    def finish(self, timeout: float = 900) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {timeout} s later:\n{self.output()}")
        self._reader.join(10)
        return rc

    def output(self) -> str:
        return "".join(self.lines)[-6000:]

    def alive(self) -> list[str]:
        left = []
        for (pid, created), name in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {name}")
            except psutil.Error:
                pass
        return left

    def kill(self) -> None:  # a failed test: nothing of it left for the next
        for (pid, created), _ in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created:
                    p.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture
def run(tmp_path):
    runs = []

    def start(*extra: str, env: dict[str, str] | None = None) -> Run:
        runs.append(Run(tmp_path / f"run{len(runs)}", *extra, env=env))
        return runs[-1]

    yield start
    for r in runs:
        r.kill()


def assert_nothing_left(r: Run) -> None:
    assert r.seen, "the census saw no process of the run"
    deadline = time.monotonic() + 5
    while r.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not r.alive(), f"alive 5 s after exit: {r.alive()}\n{r.output()}"


# Loaded by the driver alone (it takes the variable out of the environment its children inherit): every
# import's thread, those off the main thread printed at exit.
IMPORT_SPY = """
import os
if os.environ.pop("MOE_RL_IMPORT_SPY", None):
    import atexit, sys, threading
    off_main = []
    class Spy:
        def find_spec(self, name, path=None, target=None):
            if threading.current_thread() is not threading.main_thread():
                off_main.append(threading.current_thread().name + ":" + name)
    sys.meta_path.insert(0, Spy())
    atexit.register(lambda: print("imports off the main thread:", off_main, flush=True))
"""


def test_normal_exit_leaves_nothing_and_the_driver_imports_in_one_thread(run, tmp_path):
    """Also: the driver imports on its main thread alone. An import in a second thread races the main
    thread's: an edit of sys.meta_path there (setuptools' distutils shim) skips a finder in the other
    (ModuleNotFoundError inside transformers), and a SIGINT raised inside an import lock leaves it held,
    so the other thread waits forever (CI saw both while the model was built beside Ray's start)."""
    (tmp_path / "spy").mkdir()
    (tmp_path / "spy" / "sitecustomize.py").write_text(IMPORT_SPY)
    path = os.pathsep.join(filter(None, [str(tmp_path / "spy"), os.environ.get("PYTHONPATH")]))
    r = run(env={"MOE_RL_IMPORT_SPY": "1", "PYTHONPATH": path})
    assert r.finish() == 0, r.output()
    assert "imports off the main thread: []" in r.output(), r.output()
    assert any("RolloutActor" in name for name in r.seen.values()), r.seen  # the census saw the engine
    assert_nothing_left(r)


def test_sigint_during_ray_start_exits_130_and_leaves_nothing(run):
    r = run()
    r.wait_for("starting Ray")
    r.wait_seen("gcs_server")  # Ray's first process is up: the interrupt lands in its start-up
    r.proc.send_signal(signal.SIGINT)
    rc = r.finish(300)
    assert rc == 130, r.output()
    assert "interrupted" in r.output()
    assert not (r.out / "history.pt").exists(), "the interrupted run trained on"
    assert_nothing_left(r)


def test_sigterm_during_training_exits_143_and_leaves_nothing(run):
    r = run("run.steps=3")
    r.wait_for("placement:")
    r.proc.send_signal(signal.SIGTERM)
    rc = r.finish(300)
    assert rc == 143, r.output()
    assert "terminated" in r.output()
    assert_nothing_left(r)


def test_engine_refused_exits_2_and_leaves_nothing(run):
    """A setting that passes the checks before Ray but that vLLM refuses when the engine starts (here a KV
    cache too small for one block): vLLM's own message in one line, exit 2 (a mistake to fix, not a
    fault a launcher would retry: a dead engine actor would have been exit 3)."""
    r = run("rollout.kv_cache_gb=0.000001")
    assert r.finish() == 2, r.output()
    assert "Traceback" not in r.output(), r.output()
    last = r.output().strip().splitlines()[-1]
    assert last.startswith("moe-rl: error: vLLM refused the engine's settings: No available memory for the "
                           "cache blocks"), r.output()
    assert_nothing_left(r)
