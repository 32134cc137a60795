"""How much one optimizer step on each group of a model's parameters changes the model, for Hugging Face
checkpoints side by side: the KL of the next-token distributions after Adam's first step (the rate times
the gradient's sign) on that group alone. A group whose step changes the model many times more than the
rest's learns that many times faster at one learning rate, or breaks first: what trainer.lr_mult is for.

    .venv/bin/python tools/lr_sensitivity.py runs/quickstart/base_model runs/quickstart_deepseek/base_model
    .venv/bin/python tools/lr_sensitivity.py CKPT --mult '*kv_a_proj*=0.0625' --mult '*kv_b_proj*=0.0625'

The gradient: of a policy-gradient loss (advantage +1 on half the rows, -1 on the others) on 16 random
sequences of 48 byte tokens, seed 0. Groups: the checkpoint's parameter names with the expert number
folded (all experts of a layer are one group). --mult scales a group's step (globs over those names, as
trainer.lr_mult scales the trainer's, whose names are megatron-core's). Prints each checkpoint's largest
groups and the KL of all groups' steps at once (x 1e-4).
"""

from __future__ import annotations

import argparse
import fnmatch
import re
from collections import defaultdict

import torch


def group_name(name: str) -> str:
    name = re.sub(r"experts\.\d+\.", "experts.", name)
    return re.sub(r"\.(weight|bias)$", "", name).removeprefix("model.")


def kl(base_BSV: torch.Tensor, new_BSV: torch.Tensor) -> float:
    """Mean over positions of KL(base || new), both log-probabilities [B, S, V]."""
    return float((base_BSV.exp() * (base_BSV - new_BSV)).sum(-1).mean())


@torch.no_grad()
def step_kl(model, ids, base, steps: list[tuple[list, float]]) -> float:
    """The KL after a sign step of each (params, rate) in `steps` (the params with their .grad), the
    weights restored after."""
    saved = [(p, p.clone()) for params, _ in steps for p in params]
    for params, rate in steps:
        for p in params:
            p.sub_(rate * torch.sign(p.grad))
    out = kl(base, torch.log_softmax(model(ids).logits.float(), -1))
    for p, s in saved:
        p.copy_(s)
    return out


def sensitivities(path: str, lr: float, mult: dict[str, float]) -> tuple[list[tuple[float, str, int]], float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (16, 48), generator=g)
    logp = torch.log_softmax(model(ids).logits.float(), -1)
    base = logp.detach()
    adv_B1 = torch.where(torch.arange(16) % 2 == 0, 1.0, -1.0)[:, None]
    loss = -(adv_B1 * logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]).mean()
    loss.backward()
    groups = defaultdict(list)
    for name, p in model.named_parameters():
        if p.grad is not None:
            groups[group_name(name)].append(p)

    def rate(group: str) -> float:
        return lr * next((f for glob, f in mult.items() if fnmatch.fnmatchcase(group, glob)), 1.0)

    rows = sorted(((step_kl(model, ids, base, [(ps, rate(name))]), name, sum(p.numel() for p in ps))
                   for name, ps in groups.items()), reverse=True)
    total = step_kl(model, ids, base, [(ps, rate(name)) for name, ps in groups.items()])
    return rows, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--mult", action="append", default=[], metavar="GLOB=FACTOR")
    args = p.parse_args()
    mult = {glob: float(f) for glob, f in (m.rsplit("=", 1) for m in args.mult)}
    for path in args.checkpoints:
        rows, total = sensitivities(path, args.lr, mult)
        print(f"{path} (lr {args.lr}{', ' + str(mult) if mult else ''}): KL x 1e-4 after a step on one group")
        for value, name, numel in rows[: args.top]:
            print(f"  {value * 1e4:9.2f}  {name:48s} {numel:>8} parameters")
        print(f"  all groups at once: {total * 1e4:.2f}")


if __name__ == "__main__":
    main()
