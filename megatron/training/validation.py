"""Validation of the Megatron-LM-style flags (``arguments.py``): derived defaults filled in, impossible
combinations refused, each with one actionable line (:class:`ArgumentError`), before any process-group work.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import TYPE_CHECKING

from megatron.training.checkpoint_tracker import (
    CheckpointError,
    latest_checkpoint,
    missing_checkpoint,
    read_latest_iteration,
)
from megatron.training.extensions import Extension, check_extension
from megatron.training.tokenizer import SIZED_BY_FLAG, tokenizer_from_args

if TYPE_CHECKING:
    from megatron.training.arguments import Args, TrainingArgs

TE_NONDETERMINISTIC_ENV = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"
"""Transformer Engine's switch for non-deterministic kernels; Megatron-Core's TE attention refuses to build in
``deterministic_mode`` unless it is ``0`` (:func:`megatron.training.initialize.deterministic_environment`
sets it)."""


def extensions(args: Args) -> list[Extension]:
    """The extra argument groups of ``args``, each checked to implement the loop's hooks."""
    return [check_extension(extra) for extra in args.extra.values()]


class ArgumentError(ValueError):
    """A bad flag or flag combination; the message says what to change."""


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
        try:  # here, not on every rank after the model is built
            found = read_latest_iteration(t.load) is not None  # a tracker that holds no number raises
            if found:
                latest_checkpoint(t.load)  # the iteration it names exists
        except CheckpointError as e:
            raise ArgumentError(str(e)) from e
        if not found and t.exit_on_missing_checkpoint:
            raise ArgumentError(f"{missing_checkpoint(t.load)}, and --exit-on-missing-checkpoint is given: pass the "
                                "--save directory of a finished run, or drop the flag to start from scratch")
        # no checkpoint, no --exit-on-missing-checkpoint: the run starts from scratch (Megatron-LM's rule;
        # pretrain says so in one line)
        if found:
            # start-up time: reading the checkpoint imports torch and Megatron-Core's dist_checkpointing
            from megatron.training.resume_checks import check_resume

            if (problem := check_resume(t)) is not None:
                raise ArgumentError(problem)


def _validate_lr_schedule(t: TrainingArgs) -> None:
    """What Megatron-Core's ``OptimizerParamScheduler`` asserts in its constructor, on every rank after the
    model is built, checked here with the flag to change."""
    default_min_lr = type(t).__dataclass_fields__["min_lr"].default
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
    elif vp is not None and layers_per_rank % vp:
        raise ArgumentError(f"{layers_per_rank} layers per pipeline rank (--num-layers {m.num_layers} / PP {pp}) "
                            f"cannot be split into --virtual-pipeline-model-parallel-size {vp} chunks")
    assert vp is not None  # one of the two was given (returned above when neither was)
    if vp == 1:  # one chunk per rank: the plain 1F1B schedule
        p.virtual_pipeline_model_parallel_size = p.num_layers_per_virtual_pipeline_stage = None
        return
    p.virtual_pipeline_model_parallel_size = vp
    p.num_layers_per_virtual_pipeline_stage = layers_per_rank // vp


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
    """``--split`` as three weights (``949,50,1``, ``949 50 1`` or a mix). Fewer than three weights are padded
    with 0 (``99,1`` is ``99,1,0``), as Megatron-Core's ``parse_and_normalize_split`` does."""
    parts = [p for item in split for p in item.replace(",", " ").split()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ArgumentError(f"--split takes one to three numbers (train, valid, test), e.g. 949,50,1; got "
                            f"{' '.join(split)}") from None
    if not 1 <= len(weights) <= 3:
        raise ArgumentError(f"--split takes one to three weights (train, valid, test; missing ones are 0), e.g. "
                            f"949,50,1; got {' '.join(split)}")
    weights += [0.0] * (3 - len(weights))
    if min(weights) < 0 or weights[0] <= 0 or not all(math.isfinite(w) for w in weights):
        raise ArgumentError(f"--split needs non-negative weights with train > 0, got {' '.join(split)}")
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
