import re
import subprocess

import pytest
from cli_runs import run_main
from conftest import ROOT, moe_rl_cli


def run(*args, timeout=120):
    """`moe-rl ARGS` as a user runs it: a process of its own. The tests whose subject is what the CLI's
    main does (its messages, exit codes, help) call it in this process (run_main), sparing each call an
    interpreter and its imports."""
    return subprocess.run([*moe_rl_cli(), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_check_config_quickstart_exits_0():
    out = run("check-config", "configs/quickstart.yaml")
    assert out.returncode == 0, out.stderr
    assert "advantage: gae" in out.stdout and "# ok:" in out.stderr


@pytest.mark.parametrize("recipe, gpus, actors", [
    ("qwen3_30b_a3b_gspo", 36, "32 policy, 4 engine"),  # 32 trainer ranks + 4 engines
    ("mixtral_8x7b_ppo", 50, "16 policy, 16 critic, 16 reference, 2 engine"),  # critic and KL reference
    ("qwen3_30b_a3b_grpo_2n8g", 16, "8 policy, 4 engine"),  # 8 trainer ranks + 4 engines of 2 GPUs
])
def test_check_config_says_how_many_gpus_a_recipe_needs(recipe, gpus, actors):
    out = run("check-config", f"configs/{recipe}.yaml", "--assume-cuda")
    assert out.returncode == 0, out.stderr
    assert f"actors: {actors}; on GPUs it needs {gpus} GPU(s) (one per actor)" in out.stderr
    # the header says so
    assert f"{gpus} GPUs" in (ROOT / "configs" / f"{recipe}.yaml").read_text().splitlines()[1]


def test_misspelled_override_is_one_line_exit_2():
    out = run("check-config", "configs/quickstart.yaml", "algorithm.gama=0.9")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 \
        and lines[0].startswith("moe-rl: error: algorithm.gama: unknown key (did you mean 'gamma'?)")
    assert "Traceback" not in out.stderr


def test_every_subcommand_has_help():
    """Every subcommand answers --help, and every argument of every subcommand says what it is."""
    import argparse

    from moe_rl.cli import build_parser

    top = run_main("--help")
    assert top.returncode == 0
    for cmd in ("check-config", "plan", "train", "tiny", "config", "bench", "convert"):
        assert cmd in top.stdout
        sub = run_main(cmd, "--help")
        assert sub.returncode == 0 and f"usage: moe-rl {cmd}" in sub.stdout and len(sub.stdout) > 150, cmd
        assert "(default: [])" not in sub.stdout, cmd

    def parsers(p, name):
        yield name, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub_name, sub in a.choices.items():
                    yield from parsers(sub, f"{name} {sub_name}")

    for name, p in parsers(build_parser(), "moe-rl"):
        for a in p._actions:
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
                assert a.help, f"{name}: {a.dest} has no help"


def test_list_registered_methods_and_the_rules_between_settings():
    out = run_main("check-config", "--list")
    assert out.returncode == 0
    methods, rules = out.stdout.strip().split("\n\n")
    assert "gspo" in methods and "tis_seq" in methods and "rloo" in methods
    listed = dict(line.split(": ", 1) for line in methods.splitlines())
    assert listed["policy_mask"] == "m2po, none, opsm" and "geo_mask, geo_tis" in listed["correction"]
    from moe_rl.config.rules import RULES

    # every rule, under its theme, as the setting it refuses and its message with the values' places
    themes = [line[:-1] for line in rules.splitlines()[1:] if not line.startswith(" ")]
    assert themes == list(RULES)
    assert len(rules.splitlines()) == 1 + len(RULES) + sum(map(len, RULES.values()))
    assert "  rollout.weight_transfer: 'ipc' needs every trainer rank to hold the same tensors, which " \
        "happens only with pp=1 and ep=1 (pp={c.parallel.pp}, ep={c.parallel.ep}); use 'nccl' or " \
        "'store'" in rules


def test_unknown_benchmark_is_a_user_error():
    out = run_main("bench", "no_such_bench")
    assert out.returncode == 2 and "available:" in out.stderr and "Traceback" not in out.stderr


def test_gae_benchmark_runs_and_ends_with_json():
    import json

    out = run("bench", "gae", "--B", "4", "--T", "64", "--repeats", "3", "--loop-rows", "4")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "gae" and figures["max_abs_err"] < 1e-5
    assert figures["max_abs_err_vs_loop"] < 1e-5  # the kernel computes what the per-token loop computes
    # even on 256 positions the kernel beats the Python loop: measured 18-30x on 1-2 busy cores; > 2
    # (median of 3 kernel timings) leaves room for a loaded CI machine and still fails a slow kernel
    assert figures["speedup_vs_loop"] > 2


def test_run_that_does_not_fit_the_cluster_is_one_line(tmp_path):
    """Separate placement on 2 CPUs: policy, critic and engine each need a CPU of their own; decided
    before Ray starts."""
    out = run_main("train", "configs/quickstart.yaml", f"run.output_dir={tmp_path}", "cluster.colocate=false",
              "cluster.num_cpus=2", "trainer.warm_start_steps=0", "trainer.warm_start_lr=1e-3",
              "trainer.warm_start_batch=16")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("moe-rl: error: the run needs 3 CPU for 3 actors")
    assert "starting Ray" not in out.stdout and "GAE kernel" not in out.stdout


def test_cli_conventions():
    """--version; each option's help shows its default; train without a config says it is required;
    --list names every registry, the aggregation modes and the environments; `config show` prints the
    resolved config."""
    from moe_rl import __version__

    assert run_main("--version").stdout.strip() == f"moe-rl {__version__}"
    tiny = run_main("tiny", "--help").stdout
    assert "architecture (Hugging Face model_type) (default: qwen3_moe)" in " ".join(tiny.split())
    assert "seed of the random weights (default: 0)" in tiny
    train = run_main("train")
    assert train.returncode == 2 \
        and train.stderr.strip().endswith("the following arguments are required: config")
    listed = dict(line.split(": ", 1)
                  for line in run_main("check-config", "--list").stdout.split("\n\n")[0].splitlines())
    assert listed["aggregation"] == "token_mean, seq_mean, seq_sum_const"
    assert {"calculator", "guess_number"} <= set(listed["environment"].split(", "))
    shown = run_main("config", "show", "configs/quickstart.yaml", "run.steps=7")
    assert shown.returncode == 0 and "  steps: 7\n" in shown.stdout
    assert "max_engine_restarts: null" in shown.stdout  # a default the file does not set
    # a GPU recipe on this box
    recipe = run_main("config", "show", "configs/qwen3_30b_a3b_gspo.yaml", "--assume-cuda")
    assert recipe.returncode == 0 and "weight_transfer: nccl" in recipe.stdout, recipe.stderr


def one_line_error(out) -> str:
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("moe-rl: error: ") or "error: argument" in lines[-1], out.stderr
    return lines[-1]


def test_file_mistakes_are_one_line_before_anything_starts(tmp_path):
    """Each mistake ends in one line within seconds: before Ray, the trainers or vLLM start."""
    import json
    import time

    from moe_rl.driver.run_checkpoints import write_loop_state

    (tmp_path / "file").write_text("x")
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    (tmp_path / "braces.yaml").write_text("{}\n")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "no_config").mkdir()
    junk = tmp_path / "out" / "checkpoints" / "step_000001"
    junk.mkdir(parents=True)
    (junk / "loop_state.pt").write_text("not a checkpoint")
    half = tmp_path / "half" / "step_000004"  # a loop state, but no policy checkpoint beside it
    half.mkdir(parents=True)
    write_loop_state(half / "loop_state.pt", {"step": 4, "version": 4, "data_pos": 64})
    import shutil

    from safetensors.torch import load_file, save_file

    assert run_main("tiny", str(tmp_path / "rm"), "--reward-model").returncode == 0
    assert run_main("tiny", str(tmp_path / "lm")).returncode == 0  # a causal LM: no score head
    biased = tmp_path / "rm_bias"  # a token classifier's head with a bias
    shutil.copytree(tmp_path / "rm", biased)
    weights = load_file(biased / "model.safetensors")
    save_file({**weights, "score.bias": weights["score.weight"][:, 0].clone()}, biased / "model.safetensors")
    other = tmp_path / "rm_vocab"  # another vocabulary, no tokenizer of its own
    shutil.copytree(tmp_path / "rm", other)
    for f in other.glob("tokenizer*"):
        f.unlink()
    (other / "config.json").write_text(json.dumps({**json.loads((other / "config.json").read_text()),
                                                   "vocab_size": 300}))
    rows = tmp_path / "eval.jsonl"
    rows.write_text(json.dumps({"secret": 3}) + "\n")
    from test_preflight import checkpoint

    (tmp_path / "rewards.py").write_text("def score(row, response):\n    return 1 / len(response)\n")
    done = tmp_path / "done"  # a run that reached its 3 steps; then one of another config (its config.yaml)
    checkpoint(done, 3)
    changed = tmp_path / "changed"
    checkpoint(changed, 2)
    (changed / "config.yaml").write_text(run_main("config", "show", "configs/quickstart.yaml",
                                                  "algorithm.lam=0.9").stdout)
    damaged = tmp_path / "damaged"
    (checkpoint(damaged, 2) / "policy" / "__0_0.distcp").write_bytes(b"")
    custom = ["examples/custom_reward/config.yaml", f"run.output_dir={tmp_path / 'run'}"]
    q = ["configs/quickstart.yaml", f"run.output_dir={tmp_path / 'run'}"]
    cases = {
        "is a directory; give a YAML file": ["train", str(tmp_path)],
        "is a directory; give a YAML file ": ["check-config", str(tmp_path)],
        "is empty; to run with every default": ["train", str(tmp_path / "empty.yaml")],
        "braces.yaml' is empty; to run with every default": ["train", str(tmp_path / "braces.yaml")],
        f"run.output_dir: '{tmp_path}/file' is a file": ["train", q[0],
                                                         f"run.output_dir={tmp_path / 'file'}"],
        "model.path: '/nonexistent' does not exist": ["train", *q, "model.path=/nonexistent"],
        f"model.path: '{tmp_path}/file' is not a directory": ["train", *q, f"model.path={tmp_path / 'file'}"],
        "no_config' has no config.json": ["train", *q, f"model.path={tmp_path / 'no_config'}"],
        "is a 'llama' model; supported: mixtral, qwen2_moe, qwen3_moe": ["train", *q,
                                                                         f"model.path={tmp_path / 'llama'}"],
        "dataset '/nonexistent.jsonl' does not exist": ["train", *q,
                                                        "environment.dataset=/nonexistent.jsonl"],
        "loop_state.pt is not a loop state this program wrote": ["train", q[0],
                                                                 f"run.output_dir={tmp_path / 'out'}"],
        "checkpoint.resume: /nonexistent is not a complete checkpoint": ["train", *q,
                                                                         "checkpoint.resume=/nonexistent"],
        "step_000004 has no policy or critic checkpoint": ["train", *q, f"checkpoint.resume={half}"],
        "rm_bias' has a score.bias": ["train", *q, f"reward_model.path={biased}"],
        "reward_model.path: '/nonexistent' does not exist": ["train", *q, "reward_model.path=/nonexistent"],
        f"reward_model.path: '{tmp_path}/lm' has no score head": ["train", *q,
                                                                  f"reward_model.path={tmp_path / 'lm'}"],
        "rm_vocab' has another tokenizer than the policy's": ["train", *q, f"reward_model.path={other}"],
        f"trainer.eval_prompts=64, but {rows} has 1 rows": ["train", *q, f"trainer.eval_dataset={rows}"],
        "rewards.py:score raised ZeroDivisionError: division by zero": ["train", *custom,
                                                                         f"environment.reward_fn={tmp_path}/rewards.py:score"],
        "rollout.max_model_len: 1024 is above the 512 positions the model "
        "has": ["train", *q, "rollout.max_model_len=1024"],
        "damaged/checkpoints/step_000002/policy/__0_0.distcp is truncated "
        "(0 of": ["train", q[0], f"run.output_dir={damaged}"],
        "run.steps: 3: this run already reached it": ["train", q[0], f"run.output_dir={done}", "run.steps=3"],
        "holds a run of another config, to be resumed from step_000002: algorithm.lam: 0.9 -> 0.95":
            ["train", q[0], f"run.output_dir={changed}"],
        "run.output_dir: is empty": ["train", q[0], "run.output_dir="],
        "run.output_dir: cannot write to '/proc/moe_rl_run'": ["train", q[0],
                                                               "run.output_dir=/proc/moe_rl_run"],
        "unrecognized arguments: --run.steps=3 (overrides take no dashes: run.steps=3)": ["train", *q,
                                                                                          "--run.steps=3"],
    }
    for expect, argv in cases.items():
        t = time.monotonic()
        out = run_main(*argv)
        line = one_line_error(out)
        assert expect.strip() in line and time.monotonic() - t < 30, (argv, line)
        assert "GAE kernel" not in out.stdout and "starting Ray" not in out.stdout  # nothing had started


def test_plan_model_config_mistakes_are_one_line(tmp_path):
    """--model-config that is not JSON, a JSON list, or has a size field of another type: one line naming
    the file (and the field)."""
    import json

    from moe_rl.config import TinyModel
    from moe_rl.tiny import VOCAB_SIZE, hf_config

    hf = hf_config(TinyModel(), eos_token_id=VOCAB_SIZE - 1, pad_token_id=VOCAB_SIZE - 2).to_dict()
    files = {"text.json": "not json\n", "list.json": "[1, 2]",
             "typed.json": json.dumps({**hf, "hidden_size": "64"}), "ok.json": json.dumps(hf)}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    expect = {"text.json": f"plan: --model-config: {tmp_path}/text.json is not valid JSON at line 1 column 1 "
                           "(Expecting value)",
              "list.json": f"plan: --model-config: {tmp_path}/list.json holds a JSON list, not an object",
              "typed.json": f'plan: {tmp_path}/typed.json: hidden_size is "64"; a whole number >= 0'}
    for name, line in expect.items():
        assert one_line_error(run_main("plan", "configs/quickstart.yaml", "--model-config",
                                       str(tmp_path / name))).startswith(
            f"moe-rl: error: {line}"), name
    assert run_main("plan", "configs/quickstart.yaml", "--model-config",
                    str(tmp_path / "ok.json")).returncode == 0


def test_tiny_and_convert_refuse_before_any_work(tmp_path):
    """`tiny` never overwrites without --overwrite; convert's layout is checked against the model's
    config (4 experts, 2 heads) before any rank starts."""
    model = tmp_path / "model"
    assert run_main("tiny", str(model)).returncode == 0
    stamp = (model / "config.json").read_text()
    assert "is not empty; give a new directory, or --overwrite" in one_line_error(
        run_main("tiny", str(model), "--seed", "1"))
    assert (model / "config.json").read_text() == stamp
    (model / "model-00001-of-00002.safetensors").write_bytes(b"another model's shard")
    assert run_main("tiny", str(model), "--seed", "1", "--overwrite").returncode == 0
    assert (model / "config.json").read_text() == stamp \
        and not (model / "model-00001-of-00002.safetensors").exists()
    assert "is a file; give a new or empty directory" in one_line_error(
        run_main("tiny", str(model / "config.json"), "--overwrite"))
    out = str(tmp_path / "converted")
    assert "argument --tp: '0' is not a positive whole number" in one_line_error(
        run_main("convert", "hf-to-mcore", str(model), out, "--tp", "0"))
    for direction, src in (("hf-to-mcore", model), ("mcore-to-hf", tmp_path / "no_checkpoint_needed_yet")):
        assert one_line_error(run_main("convert", direction, str(src), out, "--ep", "3", "--hf-config",
                                       str(model))) == \
            "moe-rl: error: --ep 3 does not divide the 4 experts"
    # a process of its own, as its ranks print the progress bar; the bar's total is the count it ends with
    ok = run("convert", "hf-to-mcore", str(model), out)
    total = re.search(r"HF -> Megatron \(rank 0\):\s+0%\|\s*\| 0/(\d+)", ok.stderr)
    assert ok.returncode == 0 and total \
        and f"from the {total.group(1)} Megatron parameters of rank 0" in ok.stdout, ok.stderr
    assert "not installed" not in ok.stderr  # megatron's TE/apex notices stay quiet
    line = one_line_error(run_main("train", "configs/quickstart.yaml", f"run.output_dir={tmp_path / 'run'}",
                                   f"model.path={model}", "parallel.tp=4", "parallel.world_size=4"))
    assert line == "moe-rl: error: parallel.tp: 4 does not divide the 2 attention heads"


@pytest.mark.parametrize("overrides, engines_get", [
    # the recipe's NCCL transfer moves whole weights; through the object store, vLLM's GPU LoRA applies them
    ([], "merged weights (adapters travel through Ray's object store, and rollout.weight_transfer is nccl)"),
    (["rollout.weight_transfer=store"], "the adapters (vLLM applies them)"),
])
def test_check_config_takes_lora_on_the_qwen3_recipe(overrides, engines_get):
    """The Qwen3 recipe as shipped (Transformer Engine layers, FP8) with LoRA: accepted, and check-config
    says how the engines will get the policy."""
    out = run("check-config", "configs/qwen3_30b_a3b_gspo.yaml", "--assume-cuda", "model.lora.rank=16",
              *overrides)
    assert out.returncode == 0, out.stderr
    assert ("# LoRA: rank 16 on linear_qkv, linear_proj, linear_fc1, linear_fc2 (transformer_engine layers); "
            f"the engines get {engines_get}") in out.stderr
