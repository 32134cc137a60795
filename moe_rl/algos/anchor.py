"""PPO-EWMA proximal anchor (guide 000 section 7.2): a normalised exponential moving average of the
policy parameters, with bias correction.

    Z_0 = 1,  theta_bar_0 = theta_0
    after update n produces theta_n:
        Z_n         = beta * Z_{n-1} + 1
        theta_bar_n = (beta * Z_{n-1} * theta_bar_{n-1} + theta_n) / Z_n
    update n+1 uses pi_{theta_bar_n} as its proximal policy pi_old.

Order matters: the anchor is advanced *after* the optimizer step, so the parameters an update produces
never anchor the loss that produced them. Works on any dict of tensors (a rank's local shards).
"""

from __future__ import annotations

import torch


class EwmaAnchor:
    def __init__(self, params: dict[str, torch.Tensor], beta: float):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"EWMA decay beta must lie in [0, 1), got {beta}")
        self.beta = beta
        self.z = 1.0
        self.n = 0
        self.params = {k: v.detach().clone().float() for k, v in params.items()}

    @torch.no_grad()
    def update(self, params: dict[str, torch.Tensor]) -> None:
        """Fold in theta_n (call once after each optimizer update)."""
        if params.keys() != self.params.keys():
            missing = sorted(set(self.params) ^ set(params))[:3]
            raise KeyError(f"EWMA anchor parameters differ from the policy's: {missing}")
        z_new = self.beta * self.z + 1.0
        keep = self.beta * self.z / z_new
        for k, p in params.items():
            self.params[k].mul_(keep).add_(p.detach().float(), alpha=1.0 / z_new)
        self.z = z_new
        self.n += 1

    def state_dict(self) -> dict:
        return {"beta": self.beta, "z": self.z, "n": self.n, "params": self.params}

    def load_state_dict(self, state: dict) -> None:
        self.beta, self.z, self.n = float(state["beta"]), float(state["z"]), int(state["n"])
        self.params = {k: v.clone() for k, v in state["params"].items()}
