"""Worker of ``tests/test_recovery_capacity.py``: the capacity boost inside Megatron's router subclass on the
CPU layer (single-rank gloo). Prints "router capacity boost ok" when every check holds."""

from __future__ import annotations

import math

import torch

from tests._ft_helpers import one_rank_gloo


def main() -> None:
    from moe_ft.compat.cpu import activate

    activate()
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    from moe_ft.megatron_ext.router import CapacityBoost, CapacityBoostConfig, PopularityRouter, attach_capacity_boost

    with one_rank_gloo():  # destroyed on leaving
        parallel_state.initialize_model_parallel()
        torch.manual_seed(0)
        cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                                moe_router_topk=2, use_cpu_initialization=True, moe_aux_loss_coeff=0.0)
        router = PopularityRouter(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        router.set_layer_number(1)
        x = torch.randn(32, 2, 16)
        with torch.no_grad():
            router.weight[0] += 0.5 * x.reshape(-1, 16).mean(0)  # make expert 0 popular
        _, unlimited = router(x)
        boost = CapacityBoost(CapacityBoostConfig(capacity_factor=1.0), moe_layers=[0], num_experts=4)
        assert attach_capacity_boost([router], boost) == 1
        _, plain = router(x)
        base = math.ceil(64 * 2 / 4)
        assert int(unlimited.sum(0)[0]) > base and int(plain.sum(0)[0]) == base, (unlimited.sum(0), plain.sum(0))
        boost.end_iteration()
        assert not boost.active
        boost.start(torch.tensor([[100.0, 0, 0, 0]]))
        _, boosted = router(x)
        assert int(boosted.sum(0)[0]) == min(int(unlimited.sum(0)[0]), math.ceil(base * 1.1)) > base, boosted.sum(0)
        assert torch.equal(boosted[:, 1:], plain[:, 1:])
        boost.end_iteration()
        assert float(boost.deficit[0, 0]) == 100.0 - (int(boosted.sum(0)[0]) - base)

        # with Megatron's own token dropping on (--moe-expert-capacity-factor), attaching the boost hands the
        # dropping to the router: inactive, it drops exactly what Megatron drops; the layer config keeps the factor
        dropping_cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                                         moe_router_topk=2, use_cpu_initialization=True, moe_aux_loss_coeff=0.0,
                                         moe_expert_capacity_factor=1.0)
        groups = ProcessGroupCollection.use_mpu_process_groups()
        megatron_router = PopularityRouter(config=dropping_cfg, pg_collection=groups)
        megatron_router.set_layer_number(1)
        with torch.no_grad():
            megatron_router.weight.copy_(router.weight)
        ref_probs, ref_map = megatron_router(x)
        assert int(ref_map.sum(0)[0]) == base
        taken = CapacityBoost(CapacityBoostConfig(capacity_factor=1.0, boost=0.1), moe_layers=[0], num_experts=4)
        assert attach_capacity_boost([megatron_router], taken) == 1
        assert megatron_router.config.moe_expert_capacity_factor is None
        assert dropping_cfg.moe_expert_capacity_factor == 1.0
        out_probs, out_map = megatron_router(x)
        assert torch.equal(out_map, ref_map) and torch.equal(out_probs, ref_probs)
        taken.start(torch.tensor([[10.0, 0, 0, 0]]))
        _, boosted_map = megatron_router(x)
        assert int(boosted_map.sum(0)[0]) == min(int(unlimited.sum(0)[0]), math.ceil(base * 1.1)) > base
        mismatched = PopularityRouter(config=dropping_cfg, pg_collection=groups)
        try:
            attach_capacity_boost([mismatched], CapacityBoost(CapacityBoostConfig(capacity_factor=2.0), moe_layers=[0],
                                                             num_experts=4))
            raise AssertionError("a base factor different from the model's must be refused")
        except ValueError as e:
            assert "differs from the model's --moe-expert-capacity-factor" in str(e)
        parallel_state.destroy_model_parallel()
    print("router capacity boost ok", flush=True)


if __name__ == "__main__":
    main()
