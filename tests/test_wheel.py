"""The package as a user installs it: a wheel built from the checkout, installed on its own (the
dependencies the venv's), run from a directory outside the checkout: `moe-rl --help` and every listed
command's (and sub-action's) `--help` answer, and `moe-rl bench`, whose benchmarks are the checkout's,
says so in one line."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow

LIST_COMMANDS = """
import argparse, moe_rl
from moe_rl.cli import build_parser
print(moe_rl.__file__)
def walk(parser, path):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                print(" ".join([*path, name]))
                walk(sub, [*path, name])
walk(build_parser(), [])
"""


def test_the_installed_wheel_answers_every_commands_help(tmp_path):
    src = tmp_path / "src"  # the sources alone: no build/ of an earlier build's files
    shutil.copytree(ROOT / "moe_rl", src / "moe_rl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"),
                    str(src)], check=True, capture_output=True, cwd=tmp_path, timeout=300)
    (wheel,) = (tmp_path / "wheel").glob("moe_rl-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the checkout's editable install

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)

    listed = run("-c", LIST_COMMANDS)
    assert listed.returncode == 0, listed.stderr[-2000:]
    where, *commands = listed.stdout.splitlines()
    assert where.startswith(str(site)), where  # the wheel's package, not the checkout's
    assert {"train", "check-config", "plan", "convert", "bench", "tiny", "config explain"} <= set(commands)
    for command in ["", *commands]:
        out = run("-m", "moe_rl.cli", *command.split(), "--help")
        assert out.returncode == 0 and out.stdout.startswith("usage: moe-rl"), (command, out.stderr[-2000:])
    bench = run("-m", "moe_rl.cli", "bench", "gae")
    assert bench.returncode == 2 and "Traceback" not in bench.stderr, bench.stderr[-2000:]
    assert bench.stderr.strip().startswith("moe-rl: error: no benchmarks at ") \
        and "run moe-rl bench from a checkout" in bench.stderr, bench.stderr
