"""CPU threads per process: each trainer rank and engine gets its share of its node's CPUs among the
processes that compute at the same time (placement.thread_counts, worked by hand), and a real Ray
placement hands those counts out (with the OMP_NUM_THREADS cap and the explicit settings)."""

import pytest
import ray
from conftest import ROOT

from moe_rl.driver.placement import Placement, thread_counts

ONE_NODE = [("policy", "a"), ("critic", "a"), ("engine", "a")]


def test_synchronous_runs_give_each_phase_the_whole_node():
    # generation, then the critic, then the policy: one process computes at a time
    assert thread_counts(ONE_NODE, {"a": 8}, 1, overlap=False) == [8, 8, 8]
    # two ranks per model compute together; the two engines generate together
    two = [("policy", "a"), ("policy", "a"), ("critic", "a"), ("critic", "a"), ("engine", "a"),
           ("engine", "a")]
    assert thread_counts(two, {"a": 8}, 1, overlap=False) == [4, 4, 4, 4, 4, 4]
    # an engine of tensor-parallel size 2 is two processes: each of its workers gets half
    assert thread_counts(ONE_NODE, {"a": 8}, 2, overlap=False) == [8, 8, 4]


def test_asynchronous_runs_split_the_node_between_training_and_generation():
    assert thread_counts(ONE_NODE, {"a": 8}, 1, overlap=True) == [4, 4, 4]
    # 2 policy ranks + an engine of 2 workers on 8 CPUs: 4 processes at once
    bundles = [("policy", "a"), ("policy", "a"), ("engine", "a")]
    assert thread_counts(bundles, {"a": 8}, 2, overlap=True) == [2, 2, 2]
    # more processes than CPUs: still one thread each
    assert thread_counts(bundles, {"a": 2}, 2, overlap=True) == [1, 1, 1]


def test_nodes_are_counted_apart_and_the_cap_bounds_every_count():
    bundles = [("policy", "a"), ("policy", "b"), ("engine", "b")]
    assert thread_counts(bundles, {"a": 16, "b": 6}, 1, overlap=True) == [16, 3, 3]
    assert thread_counts(bundles, {"a": 16, "b": 6}, 1, overlap=True, cap=4) == [4, 3, 3]


@pytest.fixture(scope="module")
def two_cpus():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_placement_hands_out_the_counts_of_its_nodes(two_cpus, monkeypatch):
    from moe_rl.config import load_config

    def threads(*overrides):
        cfg = load_config(ROOT / "configs" / "quickstart.yaml", list(overrides))
        place = Placement(cfg, cfg.actors)
        ray.util.remove_placement_group(place.pg)
        return [place.threads_of(role, i) for role, n in cfg.actors.items() for i in range(n)]

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads() == [2, 2, 2]  # policy, critic, engine on Ray's 2 CPUs, one at a time
    assert threads("rollout.async_mode=true") == [1, 1, 1]
    assert threads("parallel.world_size=2", "algorithm.advantage=grpo", "rollout.samples_per_prompt=2",
                   "critic.lr=1e-5", "critic.value_clip=0.2") == [1, 1, 2]
    assert threads("cluster.trainer_threads=3", "cluster.engine_threads=5") == [3, 3, 5]  # as given
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads() == [1, 1, 1]  # the driver's OMP_NUM_THREADS bounds the automatic counts
    assert threads("cluster.engine_threads=2") == [1, 1, 2]  # not the given ones


def test_the_engines_of_a_node_bind_their_threads_to_cores_of_their_own(two_cpus, monkeypatch):
    """Each engine's workers start after the cores of the engines placed before it on its node."""
    from moe_rl.config import load_config

    def first_cores(*overrides):
        cfg = load_config(ROOT / "configs" / "quickstart.yaml", list(overrides))
        place = Placement(cfg, cfg.actors)
        ray.util.remove_placement_group(place.pg)
        return [place.first_core(i) for i in range(cfg.actors["engine"])]

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert first_cores() == [0]
    assert first_cores("rollout.num_engines=2") == [0, 1]  # a core each
    assert first_cores("rollout.num_engines=3", "rollout.engine_tp=2", "cluster.engine_threads=2") \
        == [0, 4, 8]


def test_a_process_never_takes_more_threads_than_cpus_it_may_run_on():
    """Under a SLURM step's or a container's CPU share (here: this process pinned to one core) a count
    larger than that share (a node's CPU count, or a user's setting) is cut to it."""
    import subprocess
    import sys

    code = ("import os, torch; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from moe_rl.driver.placement import use_threads; use_threads(4); "
            "print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1"]
