"""The per-iteration metadata capture (``moe_ft/snapshot/meta.py``) stays host bookkeeping: it runs with
torch-function handling off (no device mode in its path) and reads the routers' expert biases from the
layers directly, finding exactly the buffers a walk of every module's buffers finds."""

from __future__ import annotations

import types

import torch
from torch.overrides import TorchFunctionMode

from moe_ft.popularity import ExpertPopularity, PopularityConfig
from moe_ft.snapshot.meta import capture_step_meta, expert_biases


class _Router(torch.nn.Module):
    def __init__(self, num_experts: int, bias: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(num_experts, 4))
        self.register_buffer("expert_bias", torch.arange(num_experts, dtype=torch.float32) if bias else None)


class _Layer(torch.nn.Module):
    def __init__(self, layer_number: int, bias: bool) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.mlp = torch.nn.Module()
        self.mlp.router = _Router(4, bias)
        self.mlp.register_buffer("other", torch.ones(2))  # not a router bias


def _model(first_layer: int, biases: list[bool]) -> torch.nn.Module:
    gpt = torch.nn.Module()
    gpt.decoder = torch.nn.Module()
    gpt.decoder.layers = torch.nn.ModuleList(_Layer(first_layer + i + 1, b) for i, b in enumerate(biases))
    return gpt


def _walk(model_chunks) -> dict[str, torch.Tensor]:
    """The former capture: every buffer of every module, keeping the routers' expert biases."""
    out = {}
    for chunk in model_chunks:
        gpt = getattr(chunk, "module", chunk)
        for name, buf in gpt.named_buffers():
            if name.endswith("mlp.router.expert_bias") and buf is not None:
                layer = gpt.decoder.layers[int(name.split(".")[2])].layer_number - 1
                out[f"expert_bias.L{layer}"] = buf
    return out


def test_expert_biases_match_a_full_buffer_walk():
    wrapped = types.SimpleNamespace(module=_model(2, [True, False, True]))  # DDP-style wrapper, stage 2
    chunks = [_model(0, [True, True]), wrapped]
    got, ref = expert_biases(chunks), _walk(chunks)
    assert sorted(got) == sorted(ref) == ["expert_bias.L0", "expert_bias.L1", "expert_bias.L2", "expert_bias.L4"]
    for name, t in got.items():
        assert torch.equal(t, ref[name]) and t.data_ptr() != ref[name].data_ptr()  # a copy


class _Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_capture_bypasses_torch_function_modes():
    pop = ExpertPopularity(PopularityConfig(moe_layers=[0, 1], num_experts=4))
    groups = [{"params": [], "lr": 1e-3, "betas": (0.9, 0.95), "step": torch.tensor(4.0)}]
    state = types.SimpleNamespace(optimizer=types.SimpleNamespace(get_loss_scale=lambda: torch.tensor(2.0),
                                                                  param_groups=groups),
                                  scheduler=types.SimpleNamespace(state_dict=lambda: {"num_steps": 3}),
                                  model=[_model(0, [True, True])])
    result = types.SimpleNamespace(grad_norm=torch.tensor(0.5), update_successful=True, lr=1e-3)
    import moe_ft.snapshot.meta as meta_module

    rng = meta_module.capture_rng
    meta_module.capture_rng = lambda: ({"rng.python": [3]}, {"rng.torch_cpu": torch.get_rng_state()})
    try:
        with _Counting() as mode:
            meta, tensors = capture_step_meta(iteration=4, result=result, state=state, global_batch_size=8,
                                              clip_grad=1.0, popularity=pop)
    finally:
        meta_module.capture_rng = rng
    assert mode.calls == 0
    assert meta["consumed_samples"] == 40 and meta["loss_scale"] == 2.0 and meta["grad_norm"] == 0.5
    assert {"expert_bias.L0", "expert_bias.L1", "popularity.hard", "rng.torch_cpu"} <= set(tensors)
    assert meta["param_groups"] == [{"lr": 1e-3, "betas": [0.9, 0.95]}]
    assert tensors["param_group.0.step"] == 4.0 and tensors["param_group.0.step"] is not groups[0]["step"]
