"""`moe-rl`: the command line.

    moe-rl check-config configs/quickstart.yaml algorithm.gamma=0.99
    moe-rl plan configs/qwen3_30b_a3b_gspo.yaml --model-config Qwen3-30B-A3B/config.json
    moe-rl train configs/quickstart.yaml run.steps=2
    moe-rl tiny runs/tiny --arch mixtral
    moe-rl bench gae
    moe-rl convert mcore-to-hf runs/quickstart/checkpoints/step_000300/policy export/hf

User errors print one line `moe-rl: error: ...` and exit with code 2; never a traceback. A run that
stops because a process died or hung (a trainer rank, an engine past its restarts, a call past
cluster.call_timeout_s) prints its line and exits with code 3: a launcher's retry resumes it from the
last checkpoint (launch/), where retrying a code-2 error would only repeat it.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from moe_rl.cli.errors import EXIT_FAULT, EXIT_USAGE, UserError
from moe_rl.cli.tools import add_tool_commands
from moe_rl.config import ConfigError

_python_show_warning = warnings.showwarning
REPO_ROOT = Path(__file__).resolve().parents[2]  # a checkout's root (the package installed: none)


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"moe-rl: error: {message}", file=sys.stderr)
    return code


def _cmd_check_config(args) -> int:
    from moe_rl import config

    if args.list:
        from moe_rl.config import docs, rules

        print(docs.registered(), "\nrules between settings, by theme (the setting refused: what its "
              "refusal says):", rules.listed(), sep="\n")
        return 0
    if not args.config:
        raise UserError("check-config needs a config file (or --list)")
    cfg = config.load_config(args.config, args.overrides, cuda_available=True if args.assume_cuda else None)
    sized = _size_for_check(cfg, args.config) if args.assume_cuda else ""
    print(config.dump_yaml(cfg), end="")
    par = cfg.parallel
    actors = ", ".join(f"{n} {k}" for k, n in cfg.actors.items() if n)
    shared = "colocated: GPU i holds rank i of every model and an engine worker" if cfg.cluster.colocate \
        else "one per actor"
    print(f"# ok: {args.config} — trainer ranks {par.world_size} = tp {par.tp} x pp {par.pp} x cp {par.cp} x "
          f"dp {par.dp} (ep {par.ep}); critic {'on' if cfg.critic_enabled else 'off'}; actors: {actors}; on "
          f"GPUs it needs {cfg.gpus} GPU(s) ({shared})",
          file=sys.stderr)
    lo = cfg.model.lora
    if lo.rank:
        import torch

        mode, why = cfg.lora_sync(args.assume_cuda or torch.cuda.is_available())
        gets = "the adapters (vLLM applies them)" if mode == "adapters" else f"merged weights ({why})"
        print(f"# LoRA: rank {lo.rank} on {', '.join(lo.targets)} ({cfg.model.layer_spec} layers); the "
              f"engines get {gets}", file=sys.stderr)
    if sized:
        print(sized, file=sys.stderr)
    elif cfg.cluster.ray_address:
        print(f"# the GPU-only settings are checked against the GPUs of the Ray cluster at "
              f"{cfg.cluster.ray_address} when the run joins it (--assume-cuda: against GPU nodes now)",
              file=sys.stderr)
    return 0


def _cmd_config_show(args) -> int:
    from moe_rl import config

    cfg = config.load_config(args.config, args.overrides, cuda_available=True if args.assume_cuda else None)
    print(config.dump_yaml(cfg), end="")
    return 0


def _cmd_config_docs(args) -> int:  # config explain PATH | config docs
    from moe_rl.config import docs

    print(docs.explain(args.path) if args.action == "explain" else docs.markdown(), end="")
    return 0


def _cmd_metrics(args) -> int:
    from moe_rl import glossary

    return glossary.command(args.action, getattr(args, "tag", None))


def _size_for_check(cfg, path: str) -> str:
    """check-config --assume-cuda: will the run fit the GPUs it names (cluster.gpus_per_node, gpu_memory_gb)?
    Raises UserError (one line) if not; returns what to print."""
    try:
        problems = _plan(cfg, None).problems
    except UserError as err:  # e.g. the model is not on this machine
        return f"# {err} (not sized: moe-rl plan {path} --model-config PATH)"
    if problems:
        raise UserError("; ".join(problems))
    return (f"# fits {cfg.cluster.gpus_per_node} x {cfg.cluster.gpu_memory_gb:g} GiB GPUs per node (moe-rl "
            f"plan {path} for the sizes)")


# the fields of a Hugging Face config that sizing reads as whole numbers (null: absent)
_MODEL_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "num_experts", "num_local_experts", "num_experts_per_tok",
               "moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size",
               "max_position_embeddings", "decoder_sparse_step", "first_k_dense_replace", "n_routed_experts",
               "n_shared_experts", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim", "num_nextn_predict_layers")


def _model_config(cfg, model_config: str | None) -> tuple[dict | None, str]:
    """The model's HF config that `plan` sizes (--model-config, a config.json or a directory holding
    one; else model.path's), checked: a JSON object whose size fields are whole numbers. (None, "") for
    the tiny model. UserError naming the file and the field otherwise."""
    import json

    if not (model_config or cfg.model.path):
        return None, ""
    path = Path(model_config or cfg.model.path)
    path = path if path.suffix == ".json" or path.is_file() else path / "config.json"
    flag = "--model-config" if model_config else "model.path"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"plan: no model config at {path}; pass --model-config PATH (a "
                        "config.json)") from None
    except OSError as err:
        raise UserError(f"plan: {flag}: cannot read {path} ({err.strerror or err})") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        where = f" at line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
        raise UserError(f"plan: {flag}: {path} is not valid JSON{where} ({getattr(err, 'msg', err)}); give "
                        "the model's config.json") from None
    if not isinstance(data, dict):
        raise UserError(f"plan: {flag}: {path} holds a JSON {type(data).__name__}, not an object; give the "
                        "model's config.json (an object of fields such as hidden_size)")
    for key in _MODEL_INTS:
        value = data.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise UserError(f"plan: {path}: {key} is {json.dumps(value)}; a whole number >= 0")
    return data, str(path)


def _plan(cfg, model_config: str | None):
    from moe_rl import plan
    from moe_rl.config.rules import check_layout_fits_hf_config

    hf, path = _model_config(cfg, model_config)
    where = f" ({path})" if path else ""
    try:
        hf = hf if hf is not None else plan.hf_config_of(cfg, None)
        check_layout_fits_hf_config(cfg.parallel, hf)  # the layout against the model's heads, experts, layers
        return plan.make_plan(cfg, hf)
    except KeyError as err:
        raise UserError(f"plan: the model config{where} has no {err}") from None
    except (FileNotFoundError, ValueError) as err:
        raise UserError(f"plan: {err}{where if path and path not in str(err) else ''}") from None
    # a field of another type than sizing expects
    except (TypeError, AttributeError, ZeroDivisionError) as err:
        raise UserError(f"plan: the model config{where} has a field sizing cannot use ({type(err).__name__}: "
                        f"{err})") from None


def _cmd_plan(args) -> int:
    from moe_rl import config, plan

    sizes = [f"cluster.{k}={v}"
             for k, v in (("gpus_per_node", args.gpus_per_node), ("gpu_memory_gb", args.gpu_memory_gb))
             if v is not None]
    cfg = config.load_config(args.config, [*args.overrides, *sizes], cuda_available=True)
    p = _plan(cfg, args.model_config)
    print(plan.render(p))
    for problem in p.problems:
        print(f"moe-rl: error: {problem}", file=sys.stderr)
    return EXIT_USAGE if p.problems else 0


def _cmd_train(args) -> int:
    import signal

    from moe_rl import config
    from moe_rl.driver import session

    session.handle_signals()  # SIGINT: exit 130, SIGTERM: 143; either way the run's actors and Ray stop first
    try:
        return _train(args, config)
    except KeyboardInterrupt:
        if session.INTERRUPTED and session.INTERRUPTED[0] == signal.SIGTERM:
            return _fail("terminated (SIGTERM)", 128 + signal.SIGTERM)
        raise


def _train(args, config) -> int:
    cfg = config.load_config(args.config, args.overrides)
    from moe_rl.algos.checks import BatchCheckError
    from moe_rl.driver import loop
    from moe_rl.driver.placement import PlacementError
    from moe_rl.driver.remote import fault_line
    from moe_rl.driver.rollout_actor import EngineStartError
    from moe_rl.driver.rollout_manager import RolloutError
    from moe_rl.rollout.data import DatasetError
    from moe_rl.rollout.demos import DemonstrationError
    from moe_rl.rollout.sandbox import SandboxUnavailable
    from moe_rl.weights.hf import CheckpointError

    mistakes = (DatasetError, CheckpointError, SandboxUnavailable, FileNotFoundError, PlacementError,
                BatchCheckError, RolloutError, EngineStartError, DemonstrationError)
    try:
        return loop.main(cfg, resume_with_changes=args.resume_with_changes)
    # a mistake (here or raised by a rank: Ray's error carries it), a fault, or a bug
    except Exception as err:
        mistake = getattr(err, "cause", err)
        if isinstance(mistake, mistakes):
            raise UserError(str(mistake)) from None
        line = fault_line(err)
        if line is None:
            raise
        return _fail(line, EXIT_FAULT)


def _cmd_tiny(args) -> int:
    from moe_rl.config import TinyModel
    from moe_rl.tiny import build_tiny_checkpoint

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; give a new or empty directory")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise UserError(f"{out} is not empty; give a new directory, or --overwrite to replace the model "
                        "there")
    path = build_tiny_checkpoint(out, TinyModel(arch=args.arch), seed=args.seed, overwrite=True,
                                 reward_model=args.reward_model)
    print(f"tiny {args.arch} {'reward model' if args.reward_model else 'checkpoint'} written to {path}")
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, where it has one worth showing."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == [] \
                or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    fmt = {"formatter_class": _Help}
    p = argparse.ArgumentParser(
        prog="moe-rl", **fmt,
        description="Reinforcement-learning post-training of Mixture-of-Experts LLMs "
        "(Megatron-core trainers, vLLM rollouts, Rollout Routing Replay, Ray).",
        epilog="Configs are YAML files (see configs/); any field can be overridden as section.key=value, "
        "e.g. `moe-rl train configs/quickstart.yaml run.steps=2 parallel.tp=2`.",
    )
    from moe_rl import __version__

    p.add_argument("--version", action="version", version=f"moe-rl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_run_commands, _add_doc_commands, add_tool_commands):
        add(sub, fmt)
    return p


def _add_run_commands(sub, fmt: dict) -> None:
    """check-config, plan, train, tiny."""
    c = sub.add_parser("check-config", **fmt, help="validate a config and print it fully resolved",
                       description="Load a YAML config with overrides, validate every field and the "
                       "combinations (parallel layout vs model, GPU-only features), print the result.")
    c.add_argument("config", nargs="?", help="YAML config file, e.g. configs/quickstart.yaml")
    c.add_argument("overrides", nargs="*", default=[],
                   help="section.key=value overrides (values parsed as YAML)")
    c.add_argument("--list", action="store_true", help="list the registered advantage estimators, policy "
                   "losses, corrections, aggregation modes and environments, then the rules between settings")
    c.add_argument("--assume-cuda", action="store_true",
                   help="validate as on a GPU machine (for GPU recipes checked on a CPU box)")
    c.set_defaults(fn=_cmd_check_config)

    n = sub.add_parser("plan", **fmt, help="will a config fit its GPU cluster? memory per role and GPU",
                       description="Size a run from its config and the model's Hugging Face config alone (no "
                       "weights): GPUs per role (policy, critic, reference, reward model, teachers, "
                       "engines), per-GPU memory (weights, gradients, optimizer state, activations, engine "
                       "KV cache), the host memory "
                       "of one step's routes and the bytes of one weight sync. Exit 2, one line per problem, "
                       "if it cannot fit.")
    n.add_argument("config", help="YAML config file")
    n.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides")
    n.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: cluster.gpus_per_node, 8)")
    n.add_argument("--gpu-memory-gb", type=float, help="memory of one GPU as its maker names it, read as GiB "
                   "(H100 80GB: 80; default: cluster.gpu_memory_gb, 80)")
    n.add_argument("--model-config", help="the model's config.json (default: model.path/config.json; the "
                   "tiny model when model.path is empty)")
    n.set_defaults(fn=_cmd_plan)

    t = sub.add_parser("train", **fmt, help="run RL training from a config",
                       description="Run the RL loop described by a config: rollouts, advantages, critic and "
                       "actor updates, weight sync, TensorBoard metrics, checkpoints.")
    t.add_argument("config", help="YAML config file")
    t.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides")
    t.add_argument("--resume-with-changes", action="store_true",
                   help="resume a run.output_dir whose config.yaml differs from this config in settings "
                   "beyond run.steps, logging.*, checkpoint.every/keep/at_end/resume and cluster addresses, "
                   "threads and timeouts (the changes are printed); without it such a resume is refused")
    t.set_defaults(fn=_cmd_train)

    k = sub.add_parser("tiny", **fmt, help="build a tiny random MoE checkpoint (Hugging Face format) locally",
                       description="Write a random Qwen3-MoE, Mixtral, Qwen2-MoE (shared expert), "
                       "DeepSeek-V3 or GLM-4.5 checkpoint with a byte-level tokenizer and chat template: "
                       "loadable by transformers, vLLM and mbridge.")
    k.add_argument("out", help="output directory (new or empty)")
    k.add_argument("--arch", choices=["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe"],
                   default="qwen3_moe", help="architecture (Hugging Face model_type)")
    k.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    k.add_argument("--overwrite", action="store_true", help="replace what the output directory holds")
    k.add_argument("--reward-model", action="store_true", help="a one-label *ForSequenceClassification model "
                   "(reward_model.path; critic.init_from) instead of a causal LM")
    k.set_defaults(fn=_cmd_tiny)


def _add_doc_commands(sub, fmt: dict) -> None:
    """config (show, explain, docs) and metrics (explain, docs)."""
    g = sub.add_parser("config", **fmt,
                       help="show a config fully resolved; explain a setting; every setting's docs",
                       description="`moe-rl config show CONFIG [overrides]` prints the config as a run would "
                       "use it: the file, the overrides and every default, as YAML. `moe-rl config explain "
                       "PATH` says what a setting (rollout.temperature) or a section (rollout) is; `moe-rl "
                       "config docs` prints every setting's description as Markdown (docs/config.md).")
    gsub = g.add_subparsers(dest="action", metavar="ACTION", required=True)
    gs = gsub.add_parser("show", **fmt, help="print the resolved config as YAML")
    gs.add_argument("config", help="YAML config file")
    gs.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides")
    gs.add_argument("--assume-cuda", action="store_true",
                    help="resolve as on a GPU machine (GPU recipes on a CPU box)")
    gs.set_defaults(fn=_cmd_config_show)
    ge = gsub.add_parser("explain", **fmt,
                         help="what a setting or a section is: its type, default and description")
    ge.add_argument("path", help="a setting (rollout.temperature) or a section (rollout, model.tiny)")
    ge.set_defaults(fn=_cmd_config_docs)
    gd = gsub.add_parser("docs", **fmt, help="every section and setting as Markdown (docs/config.md)")
    gd.set_defaults(fn=_cmd_config_docs)

    m = sub.add_parser("metrics", **fmt, help="what a logged metric means; every metric's docs",
                       description="`explain TAG`: what a logged scalar (policy/loss) means, its unit; "
                       "`docs`: every metric as Markdown (docs/metrics.md), from moe_rl/glossary.py.")
    msub = m.add_subparsers(dest="action", metavar="ACTION", required=True)  # explain | docs
    me = msub.add_parser("explain", **fmt, help="a logged tag's meaning and unit")
    me.add_argument("tag", help="a tag as TensorBoard shows it, e.g. policy/loss")
    me.set_defaults(fn=_cmd_metrics)
    md = msub.add_parser("docs", **fmt, help="every metric as Markdown (docs/metrics.md)")
    md.set_defaults(fn=_cmd_metrics)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A ConfigWarning as one line, `moe-rl: warning: ...`; others as Python shows them."""
    from moe_rl.schema import ConfigWarning

    if issubclass(category, ConfigWarning):
        print(f"moe-rl: warning: {message}", file=sys.stderr)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _show_warning
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides given after an option (`check-config CFG --assume-cuda a.b=1`) are overrides too
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            dashed = [e for e in extra if e.startswith("-") and "." in e.split("=", 1)[0]]
            hint = f" (overrides take no dashes: {dashed[0].lstrip('-')})" if dashed else ""
            parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        args.overrides = [*args.overrides, *extra]
    if not getattr(args, "fn", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.fn(args)
    except (ConfigError, UserError) as err:
        return _fail(str(err))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
