"""Masked model-token GAE (guide 000, section 3) — batched, no Python loop over tokens.

Timeline. Only positions with response mask m_t = 1 are actions. For sample i let q_1 < ... < q_J be
those positions (the compressed decision timeline). With frozen values V_j := V(s_{q_j}):

    delta_j = u_{q_j} + gamma * V*_{j+1} - V_j
    A_j     = delta_j + gamma * lambda * (1 - d_j) * A_{j+1},        A_{J+1} := 0
    V*_{j+1} = V_{j+1}                      for j < J
    V*_{J+1} = 0                            if the sample truly terminated (d_J = 1)
             = V(s_boundary)                if it was truncated (time or context limit)

gamma and lambda are applied once per valid model token; observation, tool and padding positions
neither advance the recursion nor receive a target. A_j is written back to raw position q_j; every
mask-0 position gets 0. The critic target is G_j = A_j^{critic} + V_j.

Rewards must already sit on action positions (turn feedback on its span's last token); rewards and
values at mask-0 positions are ignored (selected away with torch.where, so NaN or inf there is harmless).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Keep |log(gamma*lambda)| * chunk below this, so (gamma*lambda)^(-e) inside a chunk stays far from
# float32 overflow (e^40 ~ 2e17) while a chunk spans hundreds of tokens for typical gamma*lambda.
_LOG_BUDGET = 40.0


def masked_gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    terminated_B: torch.Tensor,
    boundary_value_B: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked model-token GAE with termination vs truncation bootstrapping.

    Args:
        rewards_BT: [B, T] float, u_t (already placed on action positions).
        values_BT: [B, T] float, frozen pre-update V(s_t) at every raw position.
        mask_BT: [B, T] bool or {0,1}, response mask m_t.
        terminated_B: [B] bool, d_J: True = true termination (bootstrap 0).
        boundary_value_B: [B] float, V(s_boundary) used when not terminated (ignored otherwise).
        gamma: discount in [0, 1].
        lam: trace parameter in [0, 1]; a float, or a [B] tensor (length-adaptive GAE).
        backend: "kernel" (fused C++ pass, CPU tensors), "torch" (chunked tensor ops, any device), or
            "auto" (the kernel on CPU when it builds, otherwise torch).

    Returns:
        advantages_BT: [B, T], A_j at q_j, 0 at mask-0 positions.
        returns_BT: [B, T], A_j + V_j at q_j, 0 at mask-0 positions.

    Rewards and values at mask-0 positions are never read: whatever they hold (NaN, inf), the result is
    the one with zeros there. The bootstrap V(s_boundary) is read only for truncated samples, and only
    through their last model token. Computed in float64 when values_BT is float64, else in float32
    (bf16/fp16 inputs are upcast; the result is float32).
    """
    B, T = values_BT.shape
    dtype = torch.float64 if values_BT.dtype == torch.float64 else torch.float32
    m_bool = mask_BT.bool()
    if T == 0:
        empty = torch.zeros(B, 0, dtype=dtype, device=values_BT.device)
        return empty, empty.clone()
    values, rewards = values_BT.to(dtype), rewards_BT.to(dtype)  # no copy when already in dtype
    boundary = boundary_value_B.to(dtype=dtype, device=values.device)
    boot = torch.where(terminated_B.bool(), torch.zeros_like(boundary), boundary)
    if isinstance(lam, torch.Tensor):
        g_B = (gamma * lam.to(dtype)).reshape(B)
    else:
        g_B = torch.full((B,), gamma * float(lam), dtype=dtype, device=values.device)

    if backend not in ("auto", "kernel", "torch"):
        raise ValueError(f"backend must be 'auto', 'kernel' or 'torch', not {backend!r}")
    if backend != "torch" and values.device.type == "cpu":
        kernel = _kernel(required=backend == "kernel")
        if kernel is not None:  # it selects (never multiplies) at mask-0 positions: NaN there is never read
            adv, ret = kernel.masked_gae_cpu(rewards, values, m_bool, boot, g_B, float(gamma))
            return adv, ret
    elif backend == "kernel":
        raise ValueError("the fused GAE kernel runs on CPU tensors only; use backend='torch'")

    # torch.where, not multiplication: NaN * 0 = NaN
    values = torch.where(m_bool, values, 0.0)
    rewards = torch.where(m_bool, rewards, 0.0)
    m = m_bool.to(dtype)
    v_next = _next_valid_values(values, m_bool, boot)
    delta = torch.where(m_bool, rewards + gamma * v_next - values, 0.0)
    adv = _discounted_suffix_sum(delta, m, g_B)
    return adv, torch.where(m_bool, adv + values, 0.0)


def kernel_name(src: Path, ninja: str | None = None) -> str:
    """The kernel's name in torch's extension cache, one per checkout and ninja version: torch keys its
    cache by name and rebuilds (~30 s) when the source's path changes, so two clones on one machine
    sharing a name would rebuild each time the other ran; and a ninja keeps its build log in a format of
    its own version, which another version discards, rebuilding everything. The build uses the
    environment's ninja where it has one (`kernel_build_env`), whatever PATH says.
    `ninja`: its version (default: `ninja_version`, of the ninja on PATH)."""
    ninja = ninja_version() if ninja is None else ninja
    return f"moe_rl_gae_kernel_{hashlib.sha256(f'{src.resolve()}|ninja {ninja}'.encode()).hexdigest()[:12]}"


def ninja_version() -> str:
    """`ninja --version` of the ninja on PATH (the one torch builds extensions with), or "" without one.
    Run by torch's own helper for probing tools (algos imports torch, not subprocess)."""
    from torch.utils.collect_env import run

    try:
        rc, out, _ = run(["ninja", "--version"])
    except OSError:  # no ninja on PATH
        return ""
    return out if rc == 0 else ""


@contextlib.contextmanager
def kernel_build_env(env_bin: Path = Path(sys.executable).parent):
    """PATH with the environment's own bin first while the kernel is named and built, when it holds a
    ninja: the same ninja builds it whatever order the user's PATH has from one shell to the next (a
    ninja of another version would discard the build and rebuild everything). PATH is restored after."""
    path = os.environ.get("PATH", "")
    if (env_bin / "ninja").is_file():
        os.environ["PATH"] = os.pathsep.join([str(env_bin), path])
    try:
        yield
    finally:
        os.environ["PATH"] = path


@functools.cache
def _build_kernel():
    from torch.utils.cpp_extension import load

    src = Path(__file__).with_name("gae_kernel.cpp")
    with kernel_build_env():
        return load(name=kernel_name(src), sources=[str(src)], extra_cflags=["-O3", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)


def prepare_kernel() -> bool:
    """Build (first call on a machine: ~30 s; torch caches it) and load the fused kernel ahead of its
    first use; whether it is available. `make setup` and the driver call it before any RL step."""
    return _kernel(required=False) is not None


def _kernel(required: bool):
    """The fused CPU kernel, compiled on first use and cached by torch; None if it cannot be built."""
    try:
        return _build_kernel()
    except Exception as err:  # no compiler or headers: the tensor path gives the same numbers
        if required:
            raise RuntimeError(f"cannot build the fused GAE kernel: {err}") from err
        if not getattr(_kernel, "warned", False):
            log.warning("fused GAE kernel unavailable (%s); using the tensor path", err)
            _kernel.warned = True
        return None


def _next_valid_values(values_BT: torch.Tensor, mask_BT: torch.Tensor, boot_B: torch.Tensor) -> torch.Tensor:
    """[B, T]: at each t, V at the first valid position after t, or the bootstrap value if none."""
    B, T = values_BT.shape
    idx = torch.arange(T, device=values_BT.device).expand(B, T)
    pos = torch.where(mask_BT, idx, T)
    # first valid position >= t, by a reversed running minimum
    first_at_or_after = pos.flip(1).cummin(1).values.flip(1)
    first_after = torch.cat([first_at_or_after[:, 1:], torch.full((B, 1), T, device=pos.device)], dim=1)
    padded = torch.cat([values_BT, boot_B.reshape(B, 1)], dim=1)
    return padded.gather(1, first_after)


def _discounted_suffix_sum(delta_BT: torch.Tensor, m_BT: torch.Tensor, g_B: torch.Tensor) -> torch.Tensor:
    """A_t = sum over valid k >= t of g^(n(t,k)) delta_k, where n(t,k) counts valid positions in [t, k).

    Equivalent to the compressed recursion A_j = delta_j + g A_{j+1}. Computed chunk by chunk along T:
    inside a chunk, a reversed cumulative sum of g^e * delta rescaled by g^-e (e = valid-token count
    from the chunk start); across chunks, a short loop carries the head value of the next chunk.
    """
    B, T = delta_BT.shape
    dtype = delta_BT.dtype
    zero_g = g_B <= 0
    log_g = torch.log(torch.where(zero_g, torch.ones_like(g_B), g_B))  # <= 0; g=0 handled at the end
    worst = float(-log_g.min()) if B else 0.0
    chunk = T if worst * T <= _LOG_BUDGET else max(1, int(_LOG_BUDGET / worst))
    n_chunks = math.ceil(T / chunk)
    pad = n_chunks * chunk - T
    if pad:
        delta_BT = torch.nn.functional.pad(delta_BT, (0, pad))
        m_BT = torch.nn.functional.pad(m_BT, (0, pad))
    d = delta_BT.view(B, n_chunks, chunk)
    m = m_BT.view(B, n_chunks, chunk)
    # e: valid tokens before t inside its chunk; n_c: valid tokens in chunk c
    incl = m.cumsum(2)
    e = incl - m
    n_c = incl[:, :, -1]
    lg = log_g.view(B, 1, 1)
    local = torch.exp(e * lg) * d
    local = local.flip(2).cumsum(2).flip(2)  # sum_{k >= t in chunk} g^{e_k} delta_k
    head_local = local[:, :, 0]  # value at the first valid position of each chunk (scale g^0)
    # carry: H_c = head_local_c + g^{n_c} H_{c+1}; H_{n_chunks} = 0
    decay_c = torch.exp(n_c * log_g.view(B, 1))
    heads = torch.zeros(B, n_chunks + 1, dtype=dtype, device=delta_BT.device)
    for c in range(n_chunks - 1, -1, -1):
        heads[:, c] = head_local[:, c] + decay_c[:, c] * heads[:, c + 1]
    carry_in = heads[:, 1:].unsqueeze(2)  # H_{c+1}
    adv = (local * torch.exp(-e * lg) + torch.exp((n_c.unsqueeze(2) - e) * lg) * carry_in) * m
    adv = adv.reshape(B, n_chunks * chunk)[:, :T]
    if bool(zero_g.any()):
        adv = torch.where(zero_g.view(B, 1), delta_BT[:, :T] * m_BT[:, :T], adv)
    return adv


def decoupled_gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    terminated_B: torch.Tensor,
    boundary_value_B: torch.Tensor,
    gamma: float,
    lam_actor: float | torch.Tensor,
    lam_critic: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled GAE (VC-PPO / VAPO): separate traces for the actor and the critic.

        A^actor  = GAE(gamma, lambda_actor)      -> advantages passed to the policy loss
        G^critic = GAE(gamma, lambda_critic) + V -> critic target, from the same frozen values

    Returns (advantages_BT, returns_BT), both [B, T] and 0 at mask-0 positions.
    """
    adv, _ = masked_gae(rewards_BT, values_BT, mask_BT, terminated_B, boundary_value_B, gamma, lam_actor)
    _, ret = masked_gae(rewards_BT, values_BT, mask_BT, terminated_B, boundary_value_B, gamma, lam_critic)
    return adv, ret


def length_adaptive_lambda(num_actions_B: torch.Tensor, alpha: float) -> torch.Tensor:
    """Length-adaptive trace (VAPO): lambda_i = 1 - 1 / (alpha * J_i), clamped to [0, 1].

    num_actions_B: [B] valid model-token counts J_i. Samples with J_i = 0 get lambda 0 (no actions).
    """
    J = num_actions_B.to(torch.float64)
    lam = 1.0 - 1.0 / (alpha * J.clamp(min=1e-12))
    return lam.clamp(0.0, 1.0).where(J > 0, torch.zeros_like(lam)).to(torch.float32)


def reverse_loop_gae(
    rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The common per-token reverse loop (as in popular RLHF libraries): mask-0 positions carry the next
    value and trace unchanged, and the right boundary bootstraps with 0 (every sample terminates).

    Kept as the baseline the fast path is tested and benchmarked against. Returns (advantages, returns).
    """
    B, T = values_BT.shape
    m = mask_BT.to(values_BT.dtype)
    next_value = torch.zeros(B, dtype=values_BT.dtype, device=values_BT.device)
    last = torch.zeros_like(next_value)
    adv = torch.zeros_like(values_BT)
    for t in reversed(range(T)):
        delta = rewards_BT[:, t] + gamma * next_value - values_BT[:, t]
        new_last = delta + gamma * lam * last
        next_value = values_BT[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last = new_last * m[:, t] + (1 - m[:, t]) * last
        adv[:, t] = last
    adv = adv * m
    return adv, (adv + values_BT) * m
