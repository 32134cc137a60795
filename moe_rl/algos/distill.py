"""On-policy distillation: a teacher scores the student's own sampled tokens, and the per-token reverse
KL is the student's learning signal. Pure tensor math.

For a sampled token x_t of the student's rollout (behaviour policy mu, the engine's log-probs), the
single-sample estimate of the reverse KL KL(mu || pi_teacher) at that position is

    k_t = log mu(x_t | s_t) - log pi_teacher(x_t | s_t)                                  (1)

and its expectation over x_t ~ mu is the exact reverse KL of the two next-token distributions. Used in
the policy-gradient loss as a per-token advantage, negated and scaled,

    A_t = A_t^task + c * (-k_t)          (c: algorithm.distill_coef; A^task = 0 with advantage=none)   (2)

or, with algorithm.whiten_advantages, each term whitened on its own over the step's model tokens
(W(x) = (x - mean) / std), so that c weighs two unit-variance signals:

    A_t = W(A^task)_t + c * W(-k)_t                                                              (3)

it raises the tokens the teacher likes more than the student (k_t < 0) and lowers the others. No
baseline is needed (E[grad log mu] = 0 keeps the estimate unbiased; the mean of k_t is the KL itself,
>= 0), though (3)'s centring is one (a constant: still unbiased; the tokens the student already shares
with the teacher, k_t below the mean, are raised rather than only less lowered). The discount is 0: a
token's advantage is its own term only, and its effect on later positions' KL is ignored. Everything
the loss does to an advantage applies unchanged: the ratio, the clip, TIS / IcePop weights and the
trust masks, so asynchronous and off-policy corrections hold.

The student side of (1) is mu, the policy that sampled x_t: that is what makes (1) an unbiased
estimate of the sampling policy's reverse KL (with R3 and fp32 it equals the trainer's pi_old to
~1e-7; the README's R3 parity). This is the sampled-token estimator: it needs only the teacher's
log-prob of each sampled token, so teacher and student may differ in size, architecture (of those
this project trains) and layout as long as they share the tokenizer. The full-vocabulary (top-k) KL,
which needs both models' logits at each position, is not implemented.

Shapes: [B, T]; mask_BT is bool (model tokens); every output is 0 off the mask.
"""

from __future__ import annotations

import torch


def reverse_kl_tokens(logp_student_BT: torch.Tensor, logp_teacher_BT: torch.Tensor,
                      mask_BT: torch.Tensor) -> torch.Tensor:
    """k_t of Eq. (1) on model tokens, 0 elsewhere: [B, T] float32."""
    k = logp_student_BT.float() - logp_teacher_BT.float()
    return torch.where(mask_BT, k, torch.zeros_like(k))


def distill_advantage(k_BT: torch.Tensor, coef: float) -> torch.Tensor:
    """The distillation term of Eq. (2), -c * k_t, from reverse_kl_tokens' k_BT: [B, T] float32."""
    return -coef * k_BT


def reverse_kl_figures(k_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-token reverse-KL estimates' mean and 95th percentile over the model tokens (0 with none):
    distill/reverse_kl_mean, distill/reverse_kl_p95."""
    k = k_BT[mask_BT].double()
    if k.numel() == 0:
        return {"distill/reverse_kl_mean": torch.zeros((), dtype=torch.float64),
                "distill/reverse_kl_p95": torch.zeros((), dtype=torch.float64)}
    return {"distill/reverse_kl_mean": k.mean(), "distill/reverse_kl_p95": quantile(k, 0.95)}


def quantile(x_N: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile's linear interpolation between the sorted values, for any number of them
    (torch.quantile refuses more than 2^24: a large step's model tokens)."""
    s = x_N.sort().values
    pos = q * (s.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, s.numel() - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])
