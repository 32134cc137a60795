"""The fused GAE kernel's cache key: one build per checkout and per ninja version. torch builds with the
`ninja` on PATH, and a ninja of another version discards the other's build log and rebuilds everything
(12-85 s): the environment's own ninja builds it whatever the PATH order, so one build serves every run."""

import os
from pathlib import Path

from moe_rl.algos import gae

SRC = Path(gae.__file__).with_name("gae_kernel.cpp")


def fake_ninja(where: Path, version: str) -> Path:
    where.mkdir(parents=True)
    exe = where / "ninja"
    exe.write_text(f"#!/bin/sh\necho {version}\n")
    exe.chmod(0o755)
    return where


def test_the_kernel_is_keyed_by_the_ninja_on_path(tmp_path, monkeypatch):
    old, new, same = fake_ninja(tmp_path / "sys", "1.11.1"), fake_ninja(tmp_path / "venv", "1.13.2"), \
        fake_ninja(tmp_path / "other", "1.11.1")
    names = {}
    for d in (old, new, same):
        monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
        names[d] = gae.kernel_name(SRC)
        monkeypatch.undo()
    assert names[old] != names[new]  # another ninja: another build directory, not a rebuild of the same one
    assert names[old] == names[same]  # the same version elsewhere on PATH: the same build
    assert gae.kernel_name(SRC, "1.11.1") == names[old]
    # no ninja at all: still a name (torch then says why)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert gae.ninja_version() == "" and gae.kernel_name(SRC).startswith("moe_rl_gae_kernel_")


def test_one_build_whichever_ninja_comes_first_on_path(tmp_path, monkeypatch):
    """The environment's own ninja builds the kernel whatever the user's PATH order (the venv's bin
    first in one shell, the system's ninja first in the next): one name, one build, no rebuild."""
    system, env_bin = fake_ninja(tmp_path / "sys", "1.11.1"), fake_ninja(tmp_path / "venv", "1.13.2")
    names = set()
    for first, second in ((system, env_bin), (env_bin, system)):
        monkeypatch.setenv("PATH", os.pathsep.join([str(first), str(second), os.environ["PATH"]]))
        with gae.kernel_build_env(env_bin):
            names.add(gae.kernel_name(SRC))
        assert os.environ["PATH"].startswith(str(first))  # the user's PATH back as it was
        monkeypatch.undo()
    assert names == {gae.kernel_name(SRC, "1.13.2")}
    monkeypatch.setenv("PATH", f"{system}{os.pathsep}{os.environ['PATH']}")  # an environment without ninja:
    with gae.kernel_build_env(tmp_path / "bare"):  # the one on PATH
        assert gae.ninja_version() == "1.11.1"
