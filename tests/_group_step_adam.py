"""An AdamW that counts its step in the parameter group, as Transformer Engine's and Apex's ``FusedAdam``
do (``group["step"]``; per parameter only ``exp_avg`` and ``exp_avg_sq``). Transformer Engine does not build
on CPU; this reproduces the part of its state layout that recovery must honour, with torch's AdamW
arithmetic (decoupled weight decay, or L2 with ``adam_w_mode=False``; bias correction from the group's
step)."""

from __future__ import annotations

import torch


class GroupStepAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adam_w_mode: bool = True) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            correction1 = 1 - beta1 ** group["step"]
            correction2 = 1 - beta2 ** group["step"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                grad = p.grad
                if self.adam_w_mode:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                else:
                    grad = grad.add(p, alpha=group["weight_decay"])
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / correction2).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / correction1)
        return loss
