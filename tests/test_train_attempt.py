"""A training attempt starts from what Megatron-Core's module-level state says about *this* attempt only. Under
``moe-ft launch`` a survivor trains again in the same process after a failure: the MoE aux-loss tracker still
held the failed iteration's partial sums (its forward ran, its log line never came), and the first logged
``load balancing loss`` of the next attempt (a replayed or resumed iteration) added them in."""

from __future__ import annotations

import re

import torch

from tests._ft_helpers import tiny_model_flags

torch.set_num_threads(1)


def _first_logged_balancing_loss(args, capsys) -> str:
    # Megatron and the loop are imported here, not at the top: start-up time of test collection
    from megatron.training.initialize import set_seeds
    from megatron.training.model import build_train_state
    from megatron.training.pretrain import build_data
    from megatron.training.training import train

    set_seeds(args.training.seed)
    state = build_train_state(args)
    train(state, build_data(args), args)
    return re.findall(r"load balancing loss ([0-9.]+)", capsys.readouterr().out)[0]


def test_an_attempt_does_not_log_the_failed_attempts_aux_losses(corpus, megatron_world, capsys):
    # Megatron imported here, not at the top: start-up time of test collection
    from megatron.core.transformer.moe import moe_utils

    from megatron.training.arguments import parse_args

    args = parse_args([*tiny_model_flags(seq_length=16, global_batch_size=4, train_iters=1), "--data-path", corpus],
                      world_size=1)
    clean = _first_logged_balancing_loss(args, capsys)
    # a failed attempt's forward left its partial sums (what Megatron's router records per layer)
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), layer_number=1,
                                         num_layers=args.model.num_layers)
    assert _first_logged_balancing_loss(args, capsys) == clean
