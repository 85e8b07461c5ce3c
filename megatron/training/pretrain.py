"""Build everything from validated arguments and train (the body of ``pretrain_gpt_moe.py``)."""

from __future__ import annotations

import torch.distributed as dist

from megatron.training.arguments import Args
from megatron.training.checkpoint_tracker import missing_checkpoint, read_latest_iteration
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.data import DataConfig, ReplayableData, build_datasets, check_token_ids
from megatron.training.initialize import initialize_distributed, set_seeds, shutdown
from megatron.training.model import build_train_state, vocab_size_for
from megatron.training.quiet import summary
from megatron.training.tokenizer import tokenizer_from_args
from megatron.training.training import train
from megatron.training.validation import data_blend, split_weights


def data_config(args: Args) -> DataConfig:
    t, d = args.training, args.data
    assert d.data_path is not None  # validated
    gbs = t.global_batch_size
    return DataConfig(blend=data_blend(d.data_path), split=",".join(f"{w:g}" for w in split_weights(d.split)),
                      seq_length=args.model.seq_length, seed=t.seed, cache_path=d.data_cache_path,
                      mmap_bin_files=d.mmap_bin_files,
                      sizes=(t.train_iters * gbs, t.eval_iters * gbs if t.eval_interval else None, None))


def build_data(args: Args) -> ReplayableData:
    """The job's data (Megatron-Core's ``GPTDataset``s). Build it before the process joins its process group
    (``pretrain`` does: a replacement process then builds alone), or on every rank of the group at once
    (Megatron-Core's builder then synchronizes them with barriers)."""
    tokenizer = tokenizer_from_args(args.data, args.model.vocab_size)
    config = data_config(args)
    check_token_ids(config.blend[0], vocab_size_for(args), args.data.tokenizer_type)
    t = args.training
    return ReplayableData(build_datasets(config, tokenizer), micro_batch_size=t.micro_batch_size,
                          global_batch_size=t.global_batch_size, data_parallel_size=args.data_parallel_size,
                          num_workers=args.data.num_workers)


def pretrain(args: Args, hooks=None, join_timeout_s: float | None = None):
    """Returns the training loop's report (rank-local). ``join_timeout_s``: how long forming the process
    group may wait for every rank (:func:`initialize_distributed`)."""

    data = build_data(args)  # before the process group: the dataset builder must not synchronize
    initialize_distributed(args, join_timeout_s=join_timeout_s)
    failed = True
    try:
        set_seeds(args.training.seed)
        state = build_train_state(args)
        start = 0
        if args.training.load and read_latest_iteration(args.training.load) is None:
            if dist.get_rank() == 0:  # Megatron-LM's rule (--exit-on-missing-checkpoint stopped at parsing)
                print(f"warning: {missing_checkpoint(args.training.load)}: starting from scratch "
                      "(--exit-on-missing-checkpoint stops instead)", flush=True)
        elif args.training.load:
            start = load_checkpoint(args.training.load, state, load_optim=not args.training.no_load_optim,
                                    load_rng=not args.training.no_load_rng,
                                    override_schedule=args.training.override_opt_param_scheduler)
            if dist.get_rank() == 0:
                print(f"resumed from {args.training.load} at iteration {start}", flush=True)
        save_fn = None
        if args.training.save:
            save_fn = lambda it: save_checkpoint(args.training.save, it, state, hooks=hooks)  # noqa: E731
        if dist.get_rank() == 0:
            n_params = sum(p.numel() for chunk in state.model for p in chunk.module.parameters())
            tp = (f"TP {args.parallel.tensor_model_parallel_size}{' SP' if args.parallel.sequence_parallel else ''} | "
                  if args.parallel.tensor_model_parallel_size > 1 else "")
            print(f"world {args.world_size} | {tp}PP {args.parallel.pipeline_model_parallel_size} | "
                  f"VP {args.parallel.virtual_pipeline_model_parallel_size or 1} | EP "
                  f"{args.parallel.expert_model_parallel_size} | DP {args.data_parallel_size} | "
                  f"micro-batches {args.num_microbatches} | parameters on rank 0: {n_params}", flush=True)
            if (held := summary()) is not None:  # the warnings of imports and model build (--verbose: printed)
                print(held, flush=True)
        report = train(state, data, args, start_iteration=start, hooks=hooks, save_fn=save_fn)
        failed = False
        return report
    finally:
        shutdown(failed=failed)  # a failed attempt aborts its communicators (a dead peer never completes their work)
