"""What a plan (moe_rl/plan.py) says beyond each role's bytes: the colocated phases (what one shared GPU holds
while the engines generate and while the trainers train), what the fullest node keeps in host memory, and
the plan as `moe-rl plan` prints it."""

from __future__ import annotations

GiB = 2**30

RESIDENT = ("activations", "logits")  # a trainer's transient parts: held only while it computes


def colocated_phases(roles: list, cfg) -> dict[str, tuple[float, str]]:
    """Colocated roles on one GPU, phase by phase: (bytes, what they are) for generation (the engine's
    weights, runtime and KV cache beside what the trainers keep resident: their weights, gradients and
    optimizer state, or nothing with cluster.offload, which moves those to host memory) and training
    (every trainer's peak beside the engine's runtime with rollout.sleep_engines, its weights and KV cache
    freed, else the whole engine)."""
    *trainers, engine = roles
    kept = {r.role: 0.0 if cfg.cluster.offload else sum(v for k, v in r.per_gpu.items() if k not in RESIDENT)
            for r in trainers}
    asleep = engine.per_gpu["runtime"] if cfg.rollout.sleep_engines else engine.total

    def terms(parts: list[tuple[str, float]]) -> tuple[float, str]:
        shown = [f"{name} {size / GiB:.1f}" for name, size in parts if size]
        return sum(size for _, size in parts), " + ".join(shown)

    return {"generation": terms([("engine", engine.total)] + [(r.role, kept[r.role]) for r in trainers]),
            "training": terms([(r.role, r.total) for r in trainers]
                              + [("engine asleep" if cfg.rollout.sleep_engines else "engine", asleep)])}


def node_host_memory(roles: list, cfg) -> float:
    """What the run keeps in host memory on the fullest node: the trainers' offloaded optimizer state
    (trainer.optimizer_offload), and where colocated the larger of the two phases' moves: in generation
    the trainers' weights, gradients and optimizer state (cluster.offload), in training the sleeping
    engines' weights (rollout.sleep_engines). A node holds up to gpus_per_node ranks of each model where
    the roles share GPUs (colocated), else gpus_per_node ranks in all, the heaviest first."""
    gpn = cfg.cluster.gpus_per_node
    if not cfg.cluster.colocate:
        total, room = 0.0, gpn
        for n, h in sorted(((min(r.gpus, gpn), r.host) for r in roles[:-1]), key=lambda x: -x[1]):
            total, room = total + min(n, room) * h, room - min(n, room)
        return total
    *trainers, engine = roles
    state = sum(min(r.gpus, gpn) * r.host for r in trainers)
    moved = sum(min(r.gpus, gpn) * sum(v for k, v in r.per_gpu.items() if k not in RESIDENT)
                for r in trainers) if cfg.cluster.offload else 0.0
    asleep = min(engine.gpus, gpn) * (engine.total - engine.per_gpu["runtime"] - engine.per_gpu["kv_cache"]) \
        if cfg.rollout.sleep_engines else 0.0
    return state + max(moved, asleep)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def render(plan) -> str:
    s, gb = plan.shape, GiB
    lines = [f"model: {_count(s.total)} parameters, {_count(s.active)} active per token "
             f"({s.layers} layers, {s.moe_layers} MoE with {s.experts} experts top-{s.top_k}"
             + (f"; multi-latent attention, KV rank {s.kv_lora_rank}" if s.mla else "")
             + (f"; {s.mtp_layers} multi-token-prediction layer(s) of {_count(s.mtp)} in the checkpoint, "
                "not counted" if s.mtp_layers else "") + ")",
             f"cluster: {plan.gpus} GPUs on {plan.nodes} node(s) of "
             f"{plan.gpus_per_node} x {plan.gpu_memory_gb:g} GiB"]
    width = max(9, *(len(r.role) for r in plan.roles))
    for r in plan.roles:
        parts = ", ".join(f"{k} {v / gb:.1f}" for k, v in r.per_gpu.items())
        lines.append(f"{r.role:<{width}} {r.gpus:>4} GPU(s)  per GPU {r.total / gb:6.1f} GiB  ({parts} GiB)")
        lines += [f"{'':<{width}} {n}" for n in r.notes]
    for name, (size, held) in plan.phases.items():
        lines.append(f"{name + ':':<{width}} per GPU {size / gb:6.1f} GiB  ({held} GiB)")
    held, size = plan.fullest
    lines.append(f"fullest GPU: {held} {size / gb:.1f} of {plan.gpu_memory_gb:g} GiB, "
                 f"{plan.headroom:.0%} free")
    lines.append(f"routes of one step (host): {plan.route_bytes / gb:.2f} GiB at most; one weight sync moves "
                 f"{plan.sync_bytes / gb:.1f} GiB")
    if plan.host_bytes > plan.route_bytes:
        states = ", ".join(f"{r.role} {r.host / gb:.1f} GiB a rank" for r in plan.roles if r.host)
        lines.append(f"host memory: the fullest node {plan.host_bytes / gb:.1f} of {plan.host_memory_gb:g} "
                     "GiB (offloaded state, the routes" + (f"; optimizer state: {states}" if states else "")
                     + ")")
    if plan.adapter_params:
        lines.append(f"LoRA: {_count(plan.adapter_params)} adapter parameters "
                     f"({plan.adapter_params / s.total:.2%} of the model) train, the base is frozen; the "
                     + ("engines apply the adapters: a sync moves them alone (above)"
                        if plan.lora_sync[0] == "adapters" else
                        f"engines get merged weights (the sync above: {plan.lora_sync[1]})"))
    return "\n".join(lines)
