"""Megatron-LM-style command-line flags, mapped one-to-one onto config dataclasses, and their validation.

Validation runs before any process-group work and stops with one actionable line (:class:`ArgumentError`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from megatron.training.argument_utils import add_dataclass_arguments, dataclass_from_args, field_help
from megatron.training.tokenizer import TOKENIZER_TYPES
from megatron.training.unsupported_flags import check_unsupported
from megatron.training.validation import ArgumentError, extensions, validate_args


@dataclass(kw_only=True)
class ModelArgs:
    num_layers: int = field(default=2, metadata=field_help("Number of transformer layers."))
    hidden_size: int = field(default=64, metadata=field_help("Transformer hidden size."))
    num_attention_heads: int = field(default=4, metadata=field_help("Number of attention heads."))
    ffn_hidden_size: int | None = field(
        default=None, metadata=field_help("Hidden size of each expert's MLP (default 4*hidden).")
    )
    seq_length: int = field(default=64, metadata=field_help("Sequence length of a training sample."))
    max_position_embeddings: int | None = field(
        default=None, metadata=field_help("Positions of the learned position embedding (>= seq length).")
    )
    num_experts: int = field(default=4, metadata=field_help("Experts per MoE layer."))
    moe_router_topk: int = field(default=2, metadata=field_help("Experts each token is routed to."))
    moe_aux_loss_coeff: float = field(default=0.01, metadata=field_help("Load-balancing loss coefficient."))
    moe_expert_capacity_factor: float | None = field(default=None, metadata=field_help(
        "Capacity factor of each expert: it keeps at most ceil(factor x tokens x topk / experts) tokens per "
        "micro-batch, its highest-probability ones (Megatron's drop policy 'probs'); default: no dropping."))
    moe_token_dispatcher_type: str = field(
        default="alltoall",
        metadata=field_help("Megatron token dispatcher; 'flexible' is moe-ft's Lazarus dispatcher "
                            "with replicated experts (--ft-expert-* flags).",
                            choices=["alltoall", "allgather", "flexible"]),
    )
    moe_grouped_gemm: bool = field(default=False, metadata=field_help("Use grouped-GEMM experts."))
    vocab_size: int | None = field(
        default=None, metadata=field_help("Vocabulary size (default: the tokenizer's, padded).")
    )
    make_vocab_size_divisible_by: int = field(default=128, metadata=field_help("Pad the vocab to this."))
    bf16: bool = field(default=False, metadata=field_help("bf16 compute with fp32 master weights."))
    fp16: bool = field(default=False, metadata=field_help("fp16 compute with loss scaling."))
    transformer_impl: str = field(
        default="local", metadata=field_help("Layer implementation: Megatron-Core local modules, or "
                                             "Transformer Engine (GPU; FP8 without it: --fp8-emulation).",
                                             choices=["local", "transformer_engine"]))
    fp8_format: str | None = field(
        default=None, metadata=field_help("FP8 training (Transformer Engine, or --fp8-emulation).", choices=["e4m3", "hybrid"]))
    fp8_recipe: str = field(
        default="delayed", metadata=field_help("FP8 scaling recipe.", choices=["delayed", "tensorwise", "mxfp8",
                                                                             "blockwise"]))
    fp8_margin: int = field(default=0, metadata=field_help("FP8 scale margin: scales are divided by 2**margin."))
    fp8_amax_history_len: int = field(default=1, metadata=field_help("Past amax values kept per FP8 tensor."))
    fp8_amax_compute_algo: str = field(default="most_recent", metadata=field_help(
        "Amax the next FP8 scale is computed from.", choices=["most_recent", "max"]))
    attention_dropout: float = field(default=0.0, metadata=field_help("Attention dropout probability."))
    hidden_dropout: float = field(default=0.0, metadata=field_help("Hidden dropout probability."))


@dataclass(kw_only=True)
class ParallelArgs:
    tensor_model_parallel_size: int = field(default=1, metadata=field_help("Tensor-parallel size."))
    pipeline_model_parallel_size: int = field(default=1, metadata=field_help("Pipeline stages."))
    expert_model_parallel_size: int = field(default=1, metadata=field_help("Expert-parallel size."))
    sequence_parallel: bool = field(default=False, metadata=field_help(
        "Shard the activations outside attention and the dense layers along the sequence over the tensor-parallel "
        "ranks (needed, and checked, with --tensor-model-parallel-size > 1: Megatron-Core's MoE layer does not "
        "train without it)."))
    expert_tensor_parallel_size: int | None = field(default=None, metadata=field_help(
        "Tensor-parallel size of the experts (default: --tensor-model-parallel-size); EP x this must divide the "
        "ranks of a pipeline stage."))
    use_distributed_optimizer: bool = field(
        default=False, metadata=field_help("Shard optimizer state over data-parallel ranks.")
    )
    use_tp_pp_dp_mapping: bool = field(default=False, metadata=field_help(
        "Number the ranks tensor-, then pipeline-, then data-parallel (Megatron-Core's 'tp-cp-ep-pp-dp' order) "
        "instead of pipeline-parallel last: consecutive ranks, hence one node, hold a whole pipeline, so a lost "
        "node costs data-parallel replicas, not a stage. Megatron-Core then needs the same data-parallel size "
        "for the dense layers and the experts (expert-parallel x expert tensor-parallel size = tensor-parallel "
        "size)."))
    num_layers_per_virtual_pipeline_stage: int | None = field(default=None, metadata=field_help(
        "Layers per virtual pipeline stage: each rank holds num-layers / (PP x this) model chunks and trains "
        "with Megatron's interleaved 1F1B schedule (default: one chunk per rank, plain 1F1B)."))
    virtual_pipeline_model_parallel_size: int | None = field(default=None, metadata=field_help(
        "Model chunks (virtual pipeline stages) per pipeline rank; an alternative to "
        "--num-layers-per-virtual-pipeline-stage (give one, or both agreeing)."))


@dataclass(kw_only=True)
class TrainingArgs:
    micro_batch_size: int = field(default=2, metadata=field_help("Samples per micro-batch per DP rank."))
    global_batch_size: int | None = field(
        default=None, metadata=field_help("Samples per iteration over all DP ranks (default mbs*dp).")
    )
    train_iters: int = field(default=100, metadata=field_help("Iterations to train for."))
    lr: float = field(default=3e-3, metadata=field_help("Peak learning rate."))
    min_lr: float = field(default=3e-4, metadata=field_help("Minimum learning rate after decay."))
    lr_decay_style: str = field(
        default="cosine", metadata=field_help("LR decay.", choices=["constant", "linear", "cosine", "inverse-square-root"])
    )
    lr_warmup_iters: int = field(default=0, metadata=field_help("Linear warm-up iterations."))
    lr_decay_iters: int | None = field(default=None, metadata=field_help("Decay iterations (default train-iters)."))
    weight_decay: float = field(default=0.01, metadata=field_help("AdamW weight decay."))
    adam_beta1: float = field(default=0.9, metadata=field_help("Adam beta1."))
    adam_beta2: float = field(default=0.95, metadata=field_help("Adam beta2."))
    clip_grad: float = field(default=1.0, metadata=field_help("Global gradient-norm clip (0: off)."))
    seed: int = field(default=1234, metadata=field_help("Seed of model init, data order and dropout."))
    log_interval: int = field(default=10, metadata=field_help("Iterations between log lines."))
    eval_interval: int = field(default=0, metadata=field_help("Iterations between evaluations (0: off)."))
    eval_iters: int = field(default=2, metadata=field_help("Iterations per evaluation."))
    save: str | None = field(default=None, metadata=field_help("Directory to save checkpoints to."))
    load: str | None = field(default=None, metadata=field_help("Directory to resume from."))
    no_load_optim: bool = field(default=False, metadata=field_help(
        "--load the model but not the optimizer state (Adam moments start at zero; the iteration and the LR "
        "schedule still resume): for a checkpoint whose optimizer state does not map onto this run's, e.g. "
        "saved with another expert-parallel size."))
    no_load_rng: bool = field(default=False, metadata=field_help(
        "--load without the saved RNG states. Both flags apply to the checkpoint a run starts from: a checkpoint "
        "the run saved itself (a restart with --load and --save in one directory) loads whole."))
    exit_on_missing_checkpoint: bool = field(default=False, metadata=field_help(
        "Stop (exit 2) when --load holds no checkpoint; default: warn and start from scratch, as Megatron-LM."))
    override_opt_param_scheduler: bool = field(default=False, metadata=field_help(
        "--load, and --ft recovery from snapshots: train with the LR/WD schedule of the flags (--lr, --min-lr, "
        "--lr-warmup-iters, --lr-decay-iters, --lr-decay-style, --weight-decay) from the saved position; default: "
        "the run stops when they differ from the saved schedule."))
    use_checkpoint_opt_param_scheduler: bool = field(default=False, metadata=field_help(
        "--load, and --ft recovery from snapshots: train with the saved LR/WD schedule, whatever the flags say; "
        "default: the run stops when they differ."))
    save_interval: int = field(default=0, metadata=field_help("Iterations between saves (0: end only)."))
    loss_scale: float | None = field(default=None, metadata=field_help(
        "--fp16: static loss scale (default: dynamic loss scaling)."))
    initial_loss_scale: float = field(default=2.0 ** 32, metadata=field_help("--fp16: initial dynamic loss scale."))
    min_loss_scale: float = field(default=1.0, metadata=field_help("--fp16: minimum dynamic loss scale."))
    loss_scale_window: float = field(default=1000, metadata=field_help(
        "--fp16: iterations without overflow after which the dynamic loss scale doubles."))
    hysteresis: int = field(default=2, metadata=field_help(
        "--fp16: consecutive overflowing iterations before the dynamic loss scale halves."))
    distributed_timeout_minutes: float = field(default=10, metadata=field_help(
        "Timeout of every process group's operations, in minutes (Megatron-LM's flag; the fault-tolerance "
        "coordination group takes it too)."))
    num_threads: int = field(default=1, metadata=field_help("torch CPU threads per process (CPU runs)."))
    progress: bool = field(default=False, metadata=field_help("Show a progress bar on rank 0."))
    verbose: bool = field(default=False, metadata=field_help(
        "Print Megatron-Core's and torch's expected warnings (Transformer Engine or Apex absent, deprecations) "
        "in every rank; default: held back, one summary line on rank 0."))
    deterministic: bool = field(
        default=True, metadata=field_help("torch.use_deterministic_algorithms (bitwise reproducible).")
    )


@dataclass(kw_only=True)
class DataArgs:
    data_path: list[str] | None = field(
        default=None, metadata=field_help(
            "Megatron indexed dataset(s) (<prefix>.bin/.idx): PREFIX, or W1 PREFIX1 W2 PREFIX2 ... to blend "
            "several by weight (Megatron-LM's format).")
    )
    split: list[str] = field(
        default_factory=lambda: ["98,2,0"], metadata=field_help(
            "Train/valid/test split weights of each dataset's documents: 949,50,1 or 949 50 1; missing "
            "weights are 0 (99,1 is 99,1,0), as Megatron-Core.")
    )
    data_cache_path: str | None = field(
        default=None, metadata=field_help(
            "Directory for the datasets' shuffled indices, built once and reused by every later run and "
            "replacement process (default: Megatron-Core's own, <data prefix>/cache/GPTDataset_indices).")
    )
    mmap_bin_files: bool = field(
        default=True, metadata=field_help("Memory-map the .bin files (off: read each sample with a file read).")
    )
    num_workers: int = field(
        default=0, metadata=field_help(
            "Background threads that build the next iteration's micro-batches while this one trains "
            "(0: built when needed).")
    )
    tokenizer_type: str = field(
        default="ByteLevel", metadata=field_help(
            "Tokenizer the corpus was preprocessed with (megatron/training/tokenizer.py; all offline).",
            choices=list(TOKENIZER_TYPES))
    )
    vocab_file: str | None = field(default=None, metadata=field_help("GPT2BPETokenizer's vocab.json."))
    merge_file: str | None = field(default=None, metadata=field_help("GPT2BPETokenizer's merges.txt."))
    tokenizer_model: str | None = field(
        default=None, metadata=field_help(
            "HuggingFaceTokenizer: tokenizer.json or its directory; SentencePieceTokenizer: the .model file; "
            "TikTokenizer: its vocabulary file.")
    )


@dataclass(kw_only=True)
class Args:
    model: ModelArgs
    parallel: ParallelArgs
    training: TrainingArgs
    data: DataArgs
    world_size: int = 1
    extra: dict = field(default_factory=dict)
    """Config dataclasses of other components (e.g. ``FTConfig``), keyed by class name."""
    run_id: str = ""
    """This run's identity (:func:`run_identity` of its command line; empty: unknown). Every checkpoint it
    saves records it, and ``--no-load-optim``/``--no-load-rng`` do not apply to a checkpoint that carries it:
    a restart of the run (torchrun, ``moe-ft launch``, a resubmitted job with the same flags) loads the
    optimizer and RNG state it saved itself, the flags apply to the checkpoint the run was started from."""

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return self.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)

    @property
    def num_microbatches(self) -> int:
        t = self.training
        assert t.global_batch_size is not None  # filled in by validate_args
        return t.global_batch_size // (t.micro_batch_size * self.data_parallel_size)


GROUPS = (("model", ModelArgs, "model"), ("parallel", ParallelArgs, "parallelism"),
          ("training", TrainingArgs, "training"), ("data", DataArgs, "data"))


class OneLineParser(argparse.ArgumentParser):
    """argparse, its errors raised as :class:`ArgumentError` (one line) instead of its usage (over a hundred
    lines, on every rank) and an exit."""

    def error(self, message: str):  # type: ignore[override]
        raise ArgumentError(f"{message} (--help lists the flags)")


def build_parser(extra_groups=()) -> argparse.ArgumentParser:
    """``extra_groups``: (title, dataclass) pairs other components add (e.g. the ``--ft-*`` flags)."""
    parser = OneLineParser(description="Pretrain a Mixture-of-Experts GPT with Megatron-Core.")
    for _, cls, title in GROUPS:
        add_dataclass_arguments(parser, cls, title)
    for title, cls in extra_groups:
        add_dataclass_arguments(parser, cls, title)
    return parser


def parse_args(argv=None, world_size: int | None = None, extra_groups=()) -> Args:
    """Parse Megatron flags plus the flags of ``extra_groups`` ((title, dataclass) pairs); each extra
    dataclass instance lands in ``args.extra[cls.__name__]``. Validation errors raise
    :class:`ArgumentError` (an extra dataclass validates itself in ``__post_init__``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    check_unsupported(argv)  # Megatron-LM flags with a replacement: named with it, before argparse's answer
    namespace = build_parser(extra_groups).parse_args(argv)
    args = args_from_namespace(namespace, world_size, extra_groups)
    args.run_id = run_identity(argv)
    return args


def run_identity(argv: list[str]) -> str:
    """The identity of a run with the command line ``argv`` (the flags, in their order): the same in every
    process of the run and every restart of it, which all take the same flags; another for a run with other
    flags (a finetune from a pretraining checkpoint differs at least in ``--no-load-optim``)."""
    return hashlib.sha256("\0".join(argv).encode()).hexdigest()[:16]


def args_from_namespace(namespace: argparse.Namespace, world_size: int | None = None,
                        extra_groups=()) -> Args:
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    groups: dict[str, Any] = {name: dataclass_from_args(cls, namespace) for name, cls, _ in GROUPS}
    args = Args(**groups, world_size=world_size)
    for _, cls in extra_groups:  # built first: validation asks them what they serve (e.g. FP8 without TE)
        try:
            args.extra[cls.__name__] = dataclass_from_args(cls, namespace)
        except ValueError as e:
            raise ArgumentError(str(e)) from e
    for extra in extensions(args):  # a component may re-derive parallel sizes for this world (elastic restart)
        try:
            notes = extra.adjust_parallel(args)
        except ValueError as e:
            raise ArgumentError(str(e)) from e
        if int(os.environ.get("RANK", "0")) == 0:
            for note in notes:
                print(f"{type(extra).__name__}: {note}", flush=True)
    validate_args(args)
    for extra in extensions(args):
        try:
            extra.check_args(args)  # checks of a component's flags against the model's
        except ValueError as e:
            raise ArgumentError(str(e)) from e
    return args
