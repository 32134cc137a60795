"""GPU placement without GPUs: Ray hands out logical GPUs (`ray.init(num_gpus=4)` assigns GPU ids and sets
CUDA_VISIBLE_DEVICES per actor), so the production placement (placement group, bundle index, GPU share,
an engine's visible devices) starts tiny actors that report, from inside, the GPUs they got. Colocated,
rank i of every model and engine worker i share GPU i; separate, every actor has its own; never two ranks
of one model (NCCL refuses them) or two engines on one GPU. And the start order: colocated on GPUs, the
engines start first and alone (vLLM profiles its GPU's free memory at start-up)."""

import os
import types

import pytest
import ray
from conftest import ROOT

from moe_rl.driver import session
from moe_rl.driver.placement import Placement, PlacementError, engines_first, gpu_layout

TRAINERS = ("policy", "critic", "reference", "reward_model")
NO_CRITIC = ("algorithm.advantage=grpo", "rollout.samples_per_prompt=2", "critic.lr=1e-5",
             "critic.value_clip=0.2")
# a KL term reads a reference, the model before any warm start: none here
REFERENCE = ("algorithm.kl_loss_coef=0.01", "trainer.warm_start_steps=0", "trainer.warm_start_lr=1e-3")
SEPARATE = ("cluster.colocate=false",)


def config(*overrides):
    from moe_rl.config import load_config

    return load_config(ROOT / "configs" / "quickstart.yaml", list(overrides))


def test_the_layout_worked_by_hand():
    counts = {"policy": 2, "critic": 2, "reference": 0, "reward_model": 0, "engine": 1}
    # colocated: rank i of each model on GPU i, the engine's workers from GPU 0 on
    assert gpu_layout(counts, 1, True) == {"policy": [[0], [1]], "critic": [[0], [1]], "reference": [],
                                           "reward_model": [], "engine": [[0]]}
    assert gpu_layout(counts, 2, True)["engine"] == [[0, 1]]
    assert gpu_layout({"policy": 1, "engine": 2}, 2, True) == {"policy": [[0]], "engine": [[0, 1], [2, 3]]}
    # separate: each actor GPUs of its own, in order
    assert gpu_layout(counts, 2, False) == {"policy": [[0], [1]], "critic": [[2], [3]], "reference": [],
                                            "reward_model": [], "engine": [[4, 5]]}


@pytest.mark.parametrize("overrides, gpus", [
    ((), 1), (("parallel.world_size=2",), 2), (("rollout.engine_tp=2", "rollout.num_engines=2"), 4),
    ((*SEPARATE,), 3), ((*SEPARATE, "rollout.engine_tp=2", *REFERENCE), 5)])
def test_the_config_counts_the_gpus_the_layout_uses(overrides, gpus):
    cfg = config(*overrides)
    layout = gpu_layout(cfg.actors, cfg.rollout.engine_tp, cfg.cluster.colocate)
    assert cfg.gpus == gpus == len({g for actors in layout.values() for a in actors for g in a})


def test_engines_start_first_only_when_colocated_on_gpus():
    assert engines_first(colocate=True, gpus=2)
    assert not engines_first(colocate=False, gpus=2)  # GPUs of their own: everything at once
    assert not engines_first(colocate=True, gpus=0)  # CPU: start-up overlapped, as it always was


@pytest.fixture(scope="module")
def four_gpus():
    """One Ray with 4 logical GPUs for every layout (and 4 logical CPUs: separate actors take one each),
    and the tiny actor that reports its GPUs."""
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"MOE_RL_JOB_ENV": "kept"}})

    class Report:  # defined here: Ray ships it by value (the workers cannot import the tests)
        def gpus(self) -> dict:
            return {"ray": [str(i) for i in ray.get_gpu_ids()],
                    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "job_env": os.environ.get("MOE_RL_JOB_ENV"),
                    "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}

    yield ray.remote(Report)
    ray.shutdown()


def placed(report, cfg) -> tuple[Placement, dict[str, list[list[str]]]]:
    """Start an actor per trainer rank and engine with the production options; the GPUs each one uses
    (its CUDA_VISIBLE_DEVICES, which Ray's ids match where Ray sets it), per role."""
    place = Placement(cfg, cfg.actors)
    try:
        actors = {role: [report.options(**place.options(role, i)).remote() for i in range(n)]
                  for role, n in cfg.actors.items()}
        seen = {role: ray.get([a.gpus.remote() for a in group], timeout=120)
                for role, group in actors.items()}
    finally:
        for group in locals().get("actors", {}).values():
            for a in group:
                ray.kill(a)
        ray.util.remove_placement_group(place.pg)
    tp = cfg.rollout.engine_tp
    for role, reports in seen.items():
        for r in reports:
            assert r["job_env"] == "kept"  # an actor's own environment adds to the run's, never replaces it
            # trainer ranks: one hardware queue per GPU (megatron's TP / SP communication overlap)
            assert r["max_connections"] == (None if role == "engine" else "1"), (role, r)
            devices = r["visible"].split(",")
            assert len(devices) == (tp if role == "engine" else 1), (role, r)
            if not (role == "engine" and tp > 1):  # Ray set it: its ids are the devices
                assert r["ray"] == devices, (role, r)
    return place, {role: [r["visible"].split(",") for r in reports] for role, reports in seen.items()}


# (overrides, GPUs): 1, 2 and 4 GPUs, with and without a critic and a reference, engine_tp 1 and 2, one and
# two engines, colocated and separate (each actor a new process: a layout another one covers is left out)
LAYOUTS = [
    ((*REFERENCE,), 1),  # policy, critic, reference and the engine on one GPU
    (("parallel.world_size=2",), 2),  # the case: policy 2, critic 2, an engine
    (("rollout.engine_tp=2",), 2),
    (("parallel.world_size=2", "rollout.num_engines=2", "rollout.engine_tp=2"), 4),
    (("parallel.world_size=4", "rollout.engine_tp=2", *NO_CRITIC, *REFERENCE), 4),
    ((*SEPARATE, "parallel.world_size=2", *NO_CRITIC), 3),
    ((*SEPARATE, "rollout.engine_tp=2"), 4),
]


@pytest.mark.slow
def test_each_actor_gets_the_gpus_its_config_gives_it(four_gpus):
    """From inside each actor: colocated, every model's rank i and engine worker i (engine j's worker k is
    worker j*engine_tp+k) on one GPU; separate, no GPU shared; never two ranks of one model or two engines
    on one GPU; as many GPUs used as RunConfig.gpus says."""
    for overrides, gpus in LAYOUTS:
        cfg = config(*overrides)
        place, seen = placed(four_gpus, cfg)
        assert place.gpus == 4  # the Ray cluster's GPUs decide, not this (CPU-only) driver's torch
        assert place.engines_first == cfg.cluster.colocate
        for role, actors in seen.items():  # NCCL refuses two ranks of one group on a device
            flat = [g for a in actors for g in a]
            assert len(flat) == len(set(flat)), (overrides, role, actors)
        ranks = {role: [a[0] for a in seen[role]] for role in TRAINERS if seen[role]}
        workers = [g for a in seen["engine"] for g in a]
        if cfg.cluster.colocate:
            # rank i of every model: one GPU
            assert len(set(map(tuple, ranks.values()))) == 1, (overrides, ranks)
            shared = min(len(workers), len(ranks["policy"]))
            # engine worker i beside rank i
            assert workers[:shared] == ranks["policy"][:shared], (overrides, seen)
        used = {g for actors in seen.values() for a in actors for g in a}
        if not cfg.cluster.colocate:
            assert sum(len(a) for actors in seen.values() for a in actors) == len(used), (overrides, seen)
        assert len(used) == cfg.gpus == gpus, (overrides, seen)


@pytest.mark.slow
def test_a_run_that_needs_more_gpus_than_the_cluster_is_refused(four_gpus):
    # 4 policy + 4 critic ranks + an engine, each its own GPU
    cfg = config(*SEPARATE, "parallel.world_size=4")
    with pytest.raises(PlacementError, match="the run needs 9 GPU"):
        Placement(cfg, cfg.actors)


def test_the_run_starts_colocated_engines_before_the_trainer_ranks(monkeypatch, tmp_path):
    """startup.start follows Placement.engines_first: the engines start and finish starting before any
    trainer rank starts; otherwise both start at once and are waited for together."""
    from moe_rl.algos import gae
    from moe_rl.driver import placement, rollout_manager, startup, trainer_groups

    def order(first: bool) -> list[str]:
        events = []

        class Models:
            def __init__(self, *args):
                events.append("ranks start")
                self.policy = types.SimpleNamespace()

            def started(self):
                events.append("ranks ready")

            def groups(self):
                return {"policy": types.SimpleNamespace(nodes=["n"], threads=[1])}

        class Rollouts:
            nodes, threads = ["n"], [1]
            lora_sync, lora_sync_why = None, ""  # no LoRA policy

            def __init__(self, *args):
                events.append("engines start")

            def started(self):
                events.append("engines ready")

            def connect(self, policy):
                events.append("connect")

        monkeypatch.setattr(session, "start_ray", lambda cfg: None)
        # the stand-ins go on this test's list, not the process's (a later run would shut them down)
        monkeypatch.setattr(session, "RUN_PARTS", [])
        monkeypatch.setattr(placement, "Placement",
                            lambda cfg, counts: types.SimpleNamespace(engines_first=first))
        monkeypatch.setattr(trainer_groups, "Models", Models)
        monkeypatch.setattr(rollout_manager, "Rollouts", Rollouts)
        monkeypatch.setattr(gae, "prepare_kernel", lambda: False)
        monkeypatch.setattr(startup, "model_path", lambda cfg, out: "model")
        startup.start(config(), None, tmp_path, [], [])  # the stand-ins take no specs
        return events

    assert order(True) == ["engines start", "engines ready", "ranks start", "ranks ready", "connect"]
    assert order(False) == ["ranks start", "engines start", "ranks ready", "engines ready", "connect"]


# GPU-only settings a cluster's GPU nodes take, though the driver's own machine has no GPU
GPU_ONLY = ("model.layer_spec=transformer_engine", "model.fp8=blockwise", "rollout.weight_transfer=ipc",
            "rollout.route_source=vllm", "rollout.sleep_engines=true", "rollout.gpu_memory_utilization=0.5")
JOIN_AND_CHECK = """
import sys
from moe_rl.config import ConfigError, load_config
from moe_rl.driver import session
cfg = load_config(sys.argv[1], sys.argv[2:])  # a driver on a CPU-only login or head node
try:
    session.start_ray(cfg)
    print("joined, GPU settings taken")
except ConfigError as err:
    print(f"refused: {err}")
finally:
    session.shutdown()
"""


@pytest.mark.slow
def test_a_cpu_driver_checks_gpu_settings_against_the_cluster_it_joins(four_gpus):
    """The driver's machine (this CPU box, as a login node) decides nothing about GPUs when the run joins a
    Ray cluster: the config loads, and once joined (session.start_ray) the cluster's GPUs decide, in both
    directions, in one line naming the cluster."""
    import subprocess
    import sys

    from moe_rl.config import ConfigError
    from moe_rl.config.rules import check_machine

    address = ray.get_runtime_context().gcs_address
    with pytest.raises(ConfigError, match="'transformer_engine' needs CUDA, and this machine has none"):
        config(*GPU_ONLY)  # the run would start its own Ray here, on this CPU machine

    def join(*overrides):
        out = subprocess.run([sys.executable, "-c", JOIN_AND_CHECK, str(ROOT / "configs" / "quickstart.yaml"),
                              f"cluster.address={address}", *overrides], capture_output=True, text=True,
                             timeout=300, cwd=ROOT)
        return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]

    assert join(*GPU_ONLY) == "joined, GPU settings taken"  # the cluster has 4 GPUs
    assert join("rollout.route_source=capture") == (
        "refused: rollout.route_source: 'capture' hooks vLLM's CPU model runner, which GPU builds do not use "
        "(Model Runner V2); use 'vllm' or 'auto' with CUDA")
    # a cluster without GPUs (the same rules as this machine's, named after the cluster)
    with pytest.raises(ConfigError, match="model.layer_spec: 'transformer_engine' needs CUDA, and the Ray "
                                          "cluster at h:6379 has none; use 'local'"):
        check_machine(config(*GPU_ONLY, "cluster.address=h:6379"), False, "the Ray cluster at h:6379")
