"""The optimizer's parameter-group state (``moe_ft/state/param_groups.py``): every value but the
parameters is captured and restored, a step an optimizer counts per group (as Transformer Engine's
FusedAdam does) included; the metadata survives its JSON round trip; another layout's record restores the
values all its groups agree on."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from moe_ft.state.param_groups import capture_param_groups, restore_param_groups
from tests._group_step_adam import GroupStepAdamW


def _optimizer(steps: int, *, groups: int = 2, seed: int = 0) -> GroupStepAdamW:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(groups)]
    opt = GroupStepAdamW([{"params": [p], "wd_mult": float(i)} for i, p in enumerate(params)], lr=1e-2,
                         betas=(0.8, 0.9))
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    return opt


def _through_json(groups, tensors):
    return json.loads(json.dumps(groups)), {k: v.clone() for k, v in tensors.items()}


def test_round_trip_restores_the_group_step_and_every_value():
    src = _optimizer(5)
    groups, tensors = _through_json(*capture_param_groups(src))
    assert [g["step"] for g in groups] == [5, 5] and groups[0]["betas"] == [0.8, 0.9]
    dst = _optimizer(0)
    dst.param_groups[0]["betas"] = (0.1, 0.2)
    assert restore_param_groups(dst, groups, tensors)
    for a, b in zip(src.param_groups, dst.param_groups):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
    assert isinstance(dst.param_groups[0]["betas"], tuple)  # JSON's list back in the optimizer's form


def test_a_tensor_value_is_copied_in_place():
    opt = _optimizer(0)
    step = torch.tensor(0.0)
    opt.param_groups[0]["step"] = step
    restore_param_groups(opt, [{"step": None}, {}], {"param_group.0.step": torch.tensor(7.0)})
    assert opt.param_groups[0]["step"] is step and step.item() == 7.0


def test_the_bias_correction_follows_the_restored_step():
    """Without the group step, the optimizer resumed from step 0 and its update differs: the failure this
    record prevents."""
    ref = _optimizer(6)
    resumed = _optimizer(5)
    groups, tensors = capture_param_groups(resumed)
    fresh = _optimizer(0)  # as after a restart: weights and moments restored, the group state not yet
    for p_fresh, p_src in zip((p for g in fresh.param_groups for p in g["params"]),
                              (p for g in resumed.param_groups for p in g["params"])):
        with torch.no_grad():
            p_fresh.copy_(p_src)
        fresh.state[p_fresh] = {k: v.clone() for k, v in resumed.state[p_src].items()}
    wrong = _optimizer(0)
    for p_w, p_f in zip((p for g in wrong.param_groups for p in g["params"]),
                        (p for g in fresh.param_groups for p in g["params"])):
        with torch.no_grad():
            p_w.copy_(p_f)
        wrong.state[p_w] = {k: v.clone() for k, v in fresh.state[p_f].items()}
    restore_param_groups(fresh, groups, tensors)
    for opt in (fresh, wrong):
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = torch.ones_like(p)
        opt.step()
    final = [p for g in ref.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(final, (p for g in fresh.param_groups for p in g["params"])))
    assert not all(torch.equal(a, b) for a, b in zip(final, (p for g in wrong.param_groups for p in g["params"])))


def test_another_layout_gets_the_values_its_groups_agreed_on(caplog):
    groups, tensors = capture_param_groups(_optimizer(4, groups=3))
    dst = _optimizer(0, groups=2)
    with caplog.at_level(logging.WARNING, logger="moe_ft.state"):
        assert not restore_param_groups(dst, groups, tensors)
    assert [g["step"] for g in dst.param_groups] == [4, 4]
    assert [g["wd_mult"] for g in dst.param_groups] == [0.0, 1.0]  # differed between groups: kept
    assert "wd_mult" in caplog.text


def test_metadata_without_a_record_changes_nothing():
    opt = _optimizer(3)
    before = [dict(g) for g in opt.param_groups]
    assert not restore_param_groups(opt, None, {})
    assert [dict(g) for g in opt.param_groups] == before


def test_a_value_that_cannot_be_snapshotted_is_named():
    opt = _optimizer(0)
    opt.param_groups[1]["hook"] = object()
    with pytest.raises(TypeError, match="group 1 holds 'hook'"):
        capture_param_groups(opt)
