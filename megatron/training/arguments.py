"""Megatron-LM-style command-line flags, mapped one-to-one onto config dataclasses, and their validation.

Validation runs before any process-group work and stops with one actionable line (:class:`ArgumentError`).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from dataclasses import dataclass, field

from megatron.training.argument_utils import add_dataclass_arguments, dataclass_from_args, field_help
from megatron.training.checkpoint_tracker import CheckpointError, latest_checkpoint
from megatron.training.extensions import Extension, check_extension
from megatron.training.tokenizer import SIZED_BY_FLAG, TOKENIZER_TYPES, tokenizer_from_args

TE_NONDETERMINISTIC_ENV = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"
"""Transformer Engine's switch for non-deterministic kernels; Megatron-Core's TE attention refuses to build in
``deterministic_mode`` unless it is ``0`` (:func:`megatron.training.initialize.deterministic_environment`
sets it)."""


class ArgumentError(ValueError):
    """A bad flag or flag combination; the message says what to change."""


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
    no_load_rng: bool = field(default=False, metadata=field_help("--load without the saved RNG states."))
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
            "Train/valid/test split weights of each dataset's documents: 949,50,1 or 949 50 1.")
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


def _validate_tensor_parallel(args: Args) -> None:
    """Tensor, sequence and expert-tensor parallelism: what Megatron-Core 0.16.1 trains, checked before any
    process group (its own checks fire deep inside the model build or the first forward pass)."""
    m, p = args.model, args.parallel
    tp, etp = p.tensor_model_parallel_size, p.expert_tensor_parallel_size
    if etp is not None and etp <= 0:
        raise ArgumentError(f"--expert-tensor-parallel-size must be positive, got {etp}")
    if p.sequence_parallel and tp == 1:
        raise ArgumentError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    for size, name in ((tp, "--tensor-model-parallel-size"), (etp or tp, "the expert tensor-parallel size")):
        if ffn % size:
            raise ArgumentError(f"--ffn-hidden-size {ffn} must be divisible by {name} {size}")
    if tp == 1:
        return
    if not p.sequence_parallel:
        raise ArgumentError(f"--tensor-model-parallel-size {tp} needs --sequence-parallel: Megatron-Core's MoE layer "
                            "refuses to train with tensor parallelism without it")
    if m.num_attention_heads % tp:
        raise ArgumentError(f"--num-attention-heads {m.num_attention_heads} must be divisible by "
                            f"--tensor-model-parallel-size {tp}")
    if m.seq_length % tp:
        raise ArgumentError(f"--seq-length {m.seq_length} must be divisible by --tensor-model-parallel-size {tp} "
                            "(--sequence-parallel splits the sequence)")
    if m.moe_token_dispatcher_type == "flexible":
        raise ArgumentError("the flexible dispatcher (replicated experts) does not cover tensor parallelism: use "
                            "--moe-token-dispatcher-type alltoall or allgather with --tensor-model-parallel-size > 1")


def split_weights(split: list[str]) -> list[float]:
    """``--split`` as three weights (``949,50,1``, ``949 50 1`` or a mix)."""
    parts = [p for item in split for p in item.replace(",", " ").split()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ArgumentError(f"--split takes three numbers, e.g. 949,50,1; got {' '.join(split)}") from None
    if len(weights) != 3 or min(weights) < 0 or weights[0] <= 0:
        raise ArgumentError(f"--split needs three non-negative weights with train > 0, got {' '.join(split)}")
    return weights


def data_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """``--data-path`` as Megatron-Core's blend: ``([prefix], None)`` for one dataset, ``(prefixes,
    weights)`` for ``W1 PREFIX1 W2 PREFIX2 ...``."""
    if len(data_path) == 1:
        return list(data_path), None
    if len(data_path) % 2:
        raise ArgumentError(f"--data-path with several datasets takes weight/prefix pairs (W1 PREFIX1 W2 "
                            f"PREFIX2 ...), got an odd count: {' '.join(data_path)}")
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        raise ArgumentError(f"--data-path with several datasets takes weight/prefix pairs (W1 PREFIX1 W2 "
                            f"PREFIX2 ...); {' '.join(data_path[0::2])} are not all numbers") from None
    # Megatron-Core's BlendedDataset asserts every weight > 0 (a zero weight is no way to leave a dataset out)
    bad = [(w, prefix) for w, prefix in zip(weights, data_path[1::2]) if not (w > 0 and math.isfinite(w))]
    if bad:
        raise ArgumentError(f"--data-path weights must be positive and finite, got {bad[0][0]:g} for "
                            f"{bad[0][1]}; drop that weight/prefix pair to leave the dataset out")
    return list(data_path[1::2]), weights


@dataclass(kw_only=True)
class Args:
    model: ModelArgs
    parallel: ParallelArgs
    training: TrainingArgs
    data: DataArgs
    world_size: int = 1
    extra: dict = field(default_factory=dict)
    """Config dataclasses of other components (e.g. ``FTConfig``), keyed by class name."""

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return self.world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)

    @property
    def num_microbatches(self) -> int:
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.data_parallel_size)


GROUPS = (("model", ModelArgs, "model"), ("parallel", ParallelArgs, "parallelism"),
          ("training", TrainingArgs, "training"), ("data", DataArgs, "data"))


def build_parser(extra_groups=()) -> argparse.ArgumentParser:
    """``extra_groups``: (title, dataclass) pairs other components add (e.g. the ``--ft-*`` flags)."""
    parser = argparse.ArgumentParser(description="Pretrain a Mixture-of-Experts GPT with Megatron-Core.")
    for _, cls, title in GROUPS:
        add_dataclass_arguments(parser, cls, title)
    for title, cls in extra_groups:
        add_dataclass_arguments(parser, cls, title)
    return parser


def parse_args(argv=None, world_size: int | None = None, extra_groups=()) -> Args:
    """Parse Megatron flags plus the flags of ``extra_groups`` ((title, dataclass) pairs); each extra
    dataclass instance lands in ``args.extra[cls.__name__]``. Validation errors raise
    :class:`ArgumentError` (an extra dataclass validates itself in ``__post_init__``)."""
    namespace = build_parser(extra_groups).parse_args(argv)
    return args_from_namespace(namespace, world_size, extra_groups)


def args_from_namespace(namespace: argparse.Namespace, world_size: int | None = None,
                        extra_groups=()) -> Args:
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = Args(**{name: dataclass_from_args(cls, namespace) for name, cls, _ in GROUPS}, world_size=world_size)
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


def extensions(args: Args) -> list[Extension]:
    """The extra argument groups of ``args``, each checked to implement the loop's hooks."""
    return [check_extension(extra) for extra in args.extra.values()]


def validate_args(args: Args) -> None:
    """Fill derived defaults and reject impossible combinations, each with the fix in the message."""
    m, p, t, d = args.model, args.parallel, args.training, args.data
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "num_experts",
                 "moe_router_topk"):
        if getattr(m, name) <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be positive, got {getattr(m, name)}")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
        if getattr(p, name) <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be positive, got {getattr(p, name)}")
    _validate_tensor_parallel(args)
    if m.bf16 and m.fp16:
        raise ArgumentError("--bf16 and --fp16 are exclusive; pass one of them")
    try:  # the tokenizer's files and package, before any process starts training
        tokenizer = tokenizer_from_args(d, m.vocab_size)
    except ValueError as e:
        raise ArgumentError(str(e)) from e
    if m.vocab_size is not None and d.tokenizer_type not in SIZED_BY_FLAG and m.vocab_size < tokenizer.vocab_size:
        raise ArgumentError(f"--vocab-size {m.vocab_size} is smaller than --tokenizer-type {d.tokenizer_type}'s "
                            f"{tokenizer.vocab_size} ids; leave it out (the tokenizer's size, padded)")
    tp = p.tensor_model_parallel_size
    if m.vocab_size is not None and d.tokenizer_type not in SIZED_BY_FLAG and m.vocab_size % tp:
        # the model takes this --vocab-size unpadded (model.vocab_size_for), and Megatron-Core splits the
        # embedding and the output layer's rows evenly over the tensor-parallel ranks
        raise ArgumentError(f"--vocab-size {m.vocab_size} must be divisible by --tensor-model-parallel-size {tp}: "
                            f"pass --vocab-size {-(-m.vocab_size // tp) * tp}, or leave it out (the tokenizer's "
                            "size, padded)")
    emulated = any(e.emulates_fp8 for e in extensions(args))
    if m.fp8_format and m.transformer_impl != "transformer_engine" and not emulated:
        raise ArgumentError("--fp8-format needs --transformer-impl transformer_engine (or --fp8-emulation to run "
                            "FP8 weights without Transformer Engine)")
    if m.fp8_amax_history_len < 1 or m.fp8_margin < 0:
        raise ArgumentError("--fp8-amax-history-len must be >= 1 and --fp8-margin >= 0")
    if m.fp16:
        if t.loss_scale is not None and t.loss_scale <= 0:
            raise ArgumentError(f"--loss-scale must be positive, got {t.loss_scale}")
        if not 0 < t.min_loss_scale <= t.initial_loss_scale or t.loss_scale_window < 1 or t.hysteresis < 1:
            raise ArgumentError("dynamic loss scaling needs 0 < --min-loss-scale <= --initial-loss-scale, "
                                "--loss-scale-window >= 1 and --hysteresis >= 1")
    if m.transformer_impl == "transformer_engine":
        try:
            # optional dependency: Transformer Engine (the [gpu] extra)
            import transformer_engine  # noqa: F401
        except ImportError:
            raise ArgumentError("--transformer-impl transformer_engine needs Transformer Engine (CUDA): "
                                "pip install -e '.[gpu]' on a GPU machine, or use --transformer-impl local") from None
        allow = os.environ.get(TE_NONDETERMINISTIC_ENV)
        if t.deterministic and allow not in (None, "0"):
            raise ArgumentError(f"determinism (the default; --no-deterministic turns it off) with Transformer Engine needs "
                                f"{TE_NONDETERMINISTIC_ENV}=0, but it is {allow!r}: unset it (moe-ft then sets 0) or "
                                f"pass --no-deterministic (recovery is then not bitwise)")
    if m.moe_grouped_gemm and m.transformer_impl == "local" and importlib.util.find_spec("grouped_gemm") is None:
        raise ArgumentError("--moe-grouped-gemm with --transformer-impl local runs Megatron-Core's legacy GroupedMLP, "
                            "which needs the grouped_gemm package (CUDA): use --transformer-impl transformer_engine "
                            "(TEGroupedMLP) or drop --moe-grouped-gemm")
    if m.hidden_size % m.num_attention_heads:
        raise ArgumentError(f"--hidden-size {m.hidden_size} must be divisible by --num-attention-heads "
                            f"{m.num_attention_heads}")
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor <= 0:
        raise ArgumentError(f"--moe-expert-capacity-factor must be positive, got {m.moe_expert_capacity_factor}")
    if m.moe_router_topk > m.num_experts:
        raise ArgumentError(f"--moe-router-topk {m.moe_router_topk} exceeds --num-experts {m.num_experts}")
    if m.num_experts % p.expert_model_parallel_size:
        raise ArgumentError(f"--num-experts {m.num_experts} must be divisible by "
                            f"--expert-model-parallel-size {p.expert_model_parallel_size}")
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if args.world_size % mp:
        raise ArgumentError(f"world size {args.world_size} must be divisible by tensor x pipeline parallel "
                            f"size {mp}; change --nproc-per-node or --pipeline-model-parallel-size")
    dp = args.world_size // mp
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    per_stage = args.world_size // p.pipeline_model_parallel_size
    if per_stage % (p.expert_model_parallel_size * etp):
        raise ArgumentError(
            f"world size {args.world_size} / PP {p.pipeline_model_parallel_size} = {per_stage} ranks per stage must "
            f"be divisible by --expert-model-parallel-size {p.expert_model_parallel_size}"
            + (f" x expert tensor-parallel size {etp}" if etp > 1 else ""))
    if p.use_tp_pp_dp_mapping and p.pipeline_model_parallel_size > 1 and \
            p.expert_model_parallel_size * etp != p.tensor_model_parallel_size:
        raise ArgumentError(f"--use-tp-pp-dp-mapping with pipeline parallelism needs expert-parallel x expert "
                            f"tensor-parallel size = tensor-parallel size (Megatron-Core: the dense layers and the "
                            f"experts must have one data-parallel size), got {p.expert_model_parallel_size} x {etp}"
                            f" != {p.tensor_model_parallel_size}; drop --use-tp-pp-dp-mapping or set "
                            f"--expert-model-parallel-size {p.tensor_model_parallel_size // etp or 1}")
    if m.num_layers % p.pipeline_model_parallel_size:
        raise ArgumentError(f"--num-layers {m.num_layers} must be divisible by "
                            f"--pipeline-model-parallel-size {p.pipeline_model_parallel_size}")
    _validate_virtual_pipeline(args)
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = 4 * m.hidden_size
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.max_position_embeddings < m.seq_length:
        raise ArgumentError(f"--max-position-embeddings {m.max_position_embeddings} is smaller than "
                            f"--seq-length {m.seq_length}")
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    if t.micro_batch_size <= 0:
        raise ArgumentError(f"--micro-batch-size must be positive, got {t.micro_batch_size}")
    if t.global_batch_size <= 0 or t.global_batch_size % (t.micro_batch_size * dp):
        raise ArgumentError(f"--global-batch-size {t.global_batch_size} must be a positive multiple of "
                            f"--micro-batch-size x data-parallel size = {t.micro_batch_size} x {dp}")
    if p.pipeline_model_parallel_size > 1 and args.num_microbatches < p.pipeline_model_parallel_size:
        raise ArgumentError(f"pipeline parallelism needs at least {p.pipeline_model_parallel_size} "
                            f"micro-batches per iteration; raise --global-batch-size to "
                            f"{t.micro_batch_size * dp * p.pipeline_model_parallel_size}")
    vp = p.virtual_pipeline_model_parallel_size
    if vp is not None and args.num_microbatches % p.pipeline_model_parallel_size:
        # Megatron's interleaved schedule runs micro-batches in groups of PP per model chunk; a last group
        # smaller than PP is refused by the schedule (dependency bubbles)
        raise ArgumentError(
            f"the interleaved schedule ({vp} virtual stages) needs the micro-batches per iteration "
            f"({args.num_microbatches}) to be a multiple of --pipeline-model-parallel-size "
            f"{p.pipeline_model_parallel_size}; set --global-batch-size to a multiple of "
            f"{t.micro_batch_size * dp * p.pipeline_model_parallel_size}")
    if t.train_iters <= 0:
        raise ArgumentError(f"--train-iters must be positive, got {t.train_iters}")
    if t.lr_decay_iters is None:
        t.lr_decay_iters = t.train_iters
    _validate_lr_schedule(t)
    if t.save_interval < 0 or t.log_interval <= 0 or t.eval_interval < 0:
        raise ArgumentError("--save-interval/--eval-interval must be >= 0 and --log-interval > 0")
    if m.moe_token_dispatcher_type == "flexible" and p.use_distributed_optimizer and (t.save or t.load):
        # the distributed optimizer's dp_reshardable format stores Adam state as flat parameter buffers, whose
        # layout depends on the replica plan: a checkpoint would load only into the same plan, and silently
        # into the wrong experts when two plans happen to have equal buffer sizes
        raise ArgumentError("--save/--load with --moe-token-dispatcher-type flexible need the plain optimizer "
                            "(per-parameter optimizer state, loadable into any replica plan or standard EP); "
                            "drop --use-distributed-optimizer")
    if t.save_interval and not t.save:
        raise ArgumentError("--save-interval needs --save DIR")
    if d.data_path is None:
        raise ArgumentError("--data-path is required: prepare one with "
                            "`python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus`")
    for prefix in data_blend(d.data_path)[0]:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise ArgumentError(f"--data-path {prefix}: {prefix + suffix} not found; create it with "
                                    f"`python tools/preprocess_data.py --append-eod --output-prefix {prefix} ...`")
    weights = split_weights(d.split)
    if t.eval_interval and t.eval_iters <= 0:
        raise ArgumentError(f"--eval-interval {t.eval_interval} needs --eval-iters >= 1, got {t.eval_iters}; "
                            "pass --eval-iters 1 or more, or --eval-interval 0 to evaluate never")
    if t.eval_interval and not weights[1]:
        raise ArgumentError(f"--eval-interval {t.eval_interval} needs validation data: give --split a "
                            "validation weight, e.g. 98,2,0")
    if d.num_workers < 0:
        raise ArgumentError(f"--num-workers must be >= 0, got {d.num_workers}")
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:  # --load and FT recovery
        raise ArgumentError("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are "
                            "exclusive; pass one of them")
    if t.load:
        if not os.path.isdir(t.load):
            raise ArgumentError(f"--load {t.load}: no such directory")
        try:  # here, not on every rank after the model is built
            latest_checkpoint(t.load)
        except CheckpointError as e:
            raise ArgumentError(str(e)) from e
        # start-up time: reading the checkpoint imports torch and Megatron-Core's dist_checkpointing
        from megatron.training.resume_checks import check_resume

        if (problem := check_resume(t)) is not None:
            raise ArgumentError(problem)


def _validate_lr_schedule(t: TrainingArgs) -> None:
    """What Megatron-Core's ``OptimizerParamScheduler`` asserts in its constructor, on every rank after the
    model is built, checked here with the flag to change."""
    default_min_lr = TrainingArgs.__dataclass_fields__["min_lr"].default
    decay_iters = t.lr_decay_iters
    assert decay_iters is not None  # filled in by validate_args
    if t.min_lr < 0:
        raise ArgumentError(f"--min-lr must be >= 0, got {t.min_lr:g}")
    if t.lr < t.min_lr:
        raise ArgumentError(f"--lr {t.lr:g} is below --min-lr {t.min_lr:g} (its default is {default_min_lr:g}): "
                            f"pass --min-lr {t.lr:g} or lower, or a larger --lr")
    if decay_iters <= 0:
        raise ArgumentError(f"--lr-decay-iters must be positive, got {decay_iters}")
    if t.lr_warmup_iters < 0:
        raise ArgumentError(f"--lr-warmup-iters must be >= 0, got {t.lr_warmup_iters}")
    if t.lr_warmup_iters >= decay_iters:  # asserted for every decay style, 'constant' included
        raise ArgumentError(f"--lr-warmup-iters {t.lr_warmup_iters} must be smaller than the decay iterations "
                            f"{decay_iters} (--lr-decay-iters, default --train-iters)")


def _validate_virtual_pipeline(args: Args) -> None:
    """Resolve ``--num-layers-per-virtual-pipeline-stage`` / ``--virtual-pipeline-model-parallel-size``
    into both fields (``None`` for the plain schedule, as Megatron-LM does for one chunk per rank)."""
    m, p = args.model, args.parallel
    per_stage, vp = p.num_layers_per_virtual_pipeline_stage, p.virtual_pipeline_model_parallel_size
    if per_stage is None and vp is None:
        return
    for name, value in (("num_layers_per_virtual_pipeline_stage", per_stage),
                        ("virtual_pipeline_model_parallel_size", vp)):
        if value is not None and value <= 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be positive, got {value}")
    pp = p.pipeline_model_parallel_size
    if pp < 2:
        raise ArgumentError("virtual pipeline stages need --pipeline-model-parallel-size >= 2 (the interleaved "
                            "schedule splits each pipeline rank's layers into chunks); drop "
                            "--num-layers-per-virtual-pipeline-stage/--virtual-pipeline-model-parallel-size")
    layers_per_rank = m.num_layers // pp
    if per_stage is not None:
        if layers_per_rank % per_stage:
            raise ArgumentError(f"--num-layers {m.num_layers} / --pipeline-model-parallel-size {pp} = "
                                f"{layers_per_rank} layers per rank is not divisible by "
                                f"--num-layers-per-virtual-pipeline-stage {per_stage}")
        derived = layers_per_rank // per_stage
        if vp is not None and vp != derived:
            raise ArgumentError(f"--virtual-pipeline-model-parallel-size {vp} disagrees with "
                                f"--num-layers-per-virtual-pipeline-stage {per_stage} ({derived} chunks of "
                                f"{per_stage} layers per rank); give only one of them")
        vp = derived
    elif layers_per_rank % vp:
        raise ArgumentError(f"{layers_per_rank} layers per pipeline rank (--num-layers {m.num_layers} / PP {pp}) "
                            f"cannot be split into --virtual-pipeline-model-parallel-size {vp} chunks")
    if vp == 1:  # one chunk per rank: the plain 1F1B schedule
        p.virtual_pipeline_model_parallel_size = p.num_layers_per_virtual_pipeline_stage = None
        return
    p.virtual_pipeline_model_parallel_size = vp
    p.num_layers_per_virtual_pipeline_stage = layers_per_rank // vp
