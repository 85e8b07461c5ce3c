"""The small per-iteration state exact replay needs (MoEvement §3.3: replay must redo each iteration
exactly), captured on the training thread after the optimizer step of iteration ``t`` and stored as the
metadata entry of the snapshot of ``t``.

JSON part: ``iteration``, ``consumed_samples``, ``grad_norm``, ``clip_factor`` (Megatron's
``min(1, clip_grad / (grad_norm + 1e-6))``), ``loss_scale``, ``found_inf`` (update skipped), ``lr``,
``scheduler`` (``OptimizerParamScheduler.state_dict()``: the LR-schedule position), ``grad_scaler`` (per
Megatron optimizer, the fp16 dynamic loss scaler's scale / growth tracker / hysteresis tracker, or ``None``:
``moe_ft/precision/scaler.py``), ``policy`` (the policy's ``state_dict()``), ``popularity`` (its scalar
fields), ``rng.python``, ``param_groups`` (every optimizer parameter group's values but its parameters:
a step counted per group, betas, learning rates; ``moe_ft/state/param_groups.py``); the runtime adds
``policy_name`` and ``seed`` (``--seed``: the data order of the iterations a recovery redoes).
Tensors: ``rng.torch_cpu``, ``rng.cuda`` (if CUDA), ``rng.tracker.<name>`` (Megatron's model-parallel RNG
tracker), ``rng.numpy``, ``popularity.<counter>``, ``expert_bias.L<layer>`` (router expert bias),
``param_group.<index>.<key>`` (a group's tensor values).
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from megatron.core import tensor_parallel

from moe_ft.precision.scaler import grad_scaler_state, load_grad_scaler_state
from moe_ft.state.param_groups import META_KEY as PARAM_GROUPS
from moe_ft.state.param_groups import capture_param_groups, restore_param_groups


def capture_rng() -> tuple[dict, dict[str, torch.Tensor]]:
    tensors = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    for name, st in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        tensors[f"rng.tracker.{name}"] = st.detach().cpu().clone()
    np_state = np.random.get_state()
    tensors["rng.numpy"] = torch.from_numpy(np.asarray(np_state[1], dtype=np.int64))
    py = random.getstate()
    meta = {"rng.python": [py[0], list(py[1]), py[2]],
            "rng.numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return meta, tensors


def restore_rng(meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`capture_rng`."""

    torch.set_rng_state(tensors["rng.torch_cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    tracker = {k[len("rng.tracker."):]: v for k, v in tensors.items() if k.startswith("rng.tracker.")}
    if tracker:
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
    v, state, gauss = meta["rng.python"]
    random.setstate((v, tuple(state), gauss))
    name, pos, has_gauss, cached = meta["rng.numpy"]
    np.random.set_state((name, tensors["rng.numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))


def restore_grad_scaler(optimizer, meta: dict) -> None:
    """Put the fp16 loss scaler(s) of ``optimizer`` back to the state recorded in ``meta`` (the metadata of
    iteration ``t``: the scaler iteration ``t+1`` starts from). Metadata written before the scaler was
    recorded has no ``grad_scaler``: nothing to restore (such runs did not use ``--fp16`` exactly)."""
    states = meta.get("grad_scaler")
    if states is not None:
        load_grad_scaler_state(optimizer, states)


def restore_step_meta(meta: dict, tensors: dict[str, torch.Tensor], *, optimizer=None) -> None:
    """The per-iteration state of the metadata that lives outside the operators: RNG states and, given
    the optimizer, its loss scaler(s) and its parameter groups' values (the caller then sets the learning
    rates from the restored schedule)."""
    restore_rng(meta, tensors)
    if optimizer is not None:
        restore_grad_scaler(optimizer, meta)
        restore_param_groups(optimizer, meta.get(PARAM_GROUPS), tensors)


def capture_step_meta(*, iteration: int, result, state, global_batch_size: int, clip_grad: float,
                      policy=None, popularity=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(meta, tensors)`` for the snapshot of ``iteration``; ``result`` is the loop's ``StepResult``.

    Runs on the training thread every iteration, so it is kept to host bookkeeping: torch-function handling
    is off while it runs (the CPU compatibility layer's device mode would put each of its ~30 tensor calls
    through Python, ~10 us each; nothing here needs the mode: it creates no CUDA tensors, and ``.cpu()``
    of a device tensor is unaffected), and the routers' expert biases are read from the layers directly
    rather than by walking every module's buffers."""
    with torch._C.DisableTorchFunction():
        return _capture_step_meta(iteration, result, state, global_batch_size, clip_grad, policy, popularity)


def _capture_step_meta(iteration, result, state, global_batch_size, clip_grad, policy, popularity):
    grad_norm = float(result.grad_norm)
    clip = 1.0
    if clip_grad > 0 and math.isfinite(grad_norm):
        clip = min(1.0, clip_grad / (grad_norm + 1.0e-6))
    meta = {
        "iteration": iteration,
        "consumed_samples": (iteration + 1) * global_batch_size,
        "grad_norm": grad_norm,
        "clip_factor": clip,
        "loss_scale": float(state.optimizer.get_loss_scale()),
        "found_inf": not bool(result.update_successful),
        "lr": float(result.lr),
        "scheduler": state.scheduler.state_dict(),
        "grad_scaler": grad_scaler_state(state.optimizer),
        "policy": policy.state_dict() if policy is not None else None,
    }
    rng_meta, tensors = capture_rng()
    meta.update(rng_meta)
    meta[PARAM_GROUPS], group_tensors = capture_param_groups(state.optimizer)
    tensors.update(group_tensors)
    if popularity is not None:
        pop = popularity.state_dict()
        meta["popularity"] = {k: v for k, v in pop.items() if not isinstance(v, torch.Tensor)}
        tensors.update({f"popularity.{k}": v for k, v in pop.items() if isinstance(v, torch.Tensor)})
    tensors.update(expert_biases(state.model))
    return meta, tensors


def expert_biases(model_chunks) -> dict[str, torch.Tensor]:
    """``expert_bias.L<layer>`` → a copy of each MoE router's ``expert_bias`` buffer (aux-loss-free load
    balancing state), for the layers of ``model_chunks`` (``GPTModel`` or DDP-wrapped). ``layer`` is the
    global layer (``layer_number - 1``). The buffer lives at ``decoder.layers.<i>.mlp.router.expert_bias``."""
    out = {}
    for chunk in model_chunks:
        gpt = getattr(chunk, "module", chunk)
        for layer_module in getattr(getattr(gpt, "decoder", None), "layers", ()):
            router = getattr(getattr(layer_module, "mlp", None), "router", None)
            buf = getattr(router, "expert_bias", None)
            if isinstance(buf, torch.Tensor):
                out[f"expert_bias.L{layer_module.layer_number - 1}"] = buf.detach().cpu().clone()
    return out
