"""Build the MoE GPT model, Megatron's DDP wrapper, optimizer and LR/WD scheduler from the arguments."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.training.arguments import Args
from megatron.training.norm import with_sequence_parallel_norms
from megatron.training.resume_checks import flag_state
from megatron.training.tokenizer import SIZED_BY_FLAG, padded_vocab_size, tokenizer_from_args
from megatron.training.validation import extensions


def vocab_size_for(args: Args) -> int:
    """The model's vocabulary: ``--vocab-size``, else the tokenizer's padded (Megatron-LM's rule; with
    ``NullTokenizer`` and ``TikTokenizer``, ``--vocab-size`` is the tokenizer's, and the model pads it)."""
    m = args.model
    if m.vocab_size is not None and args.data.tokenizer_type not in SIZED_BY_FLAG:
        return m.vocab_size
    tokenizer = tokenizer_from_args(args.data, m.vocab_size)
    return padded_vocab_size(tokenizer.vocab_size, m.make_vocab_size_divisible_by,
                             args.parallel.tensor_model_parallel_size)


def transformer_config(args: Args) -> TransformerConfig:
    m, p = args.model, args.parallel
    dtype = torch.bfloat16 if m.bf16 else torch.float16 if m.fp16 else torch.float32
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        moe_ffn_hidden_size=m.ffn_hidden_size,
        num_moe_experts=m.num_experts,
        moe_router_topk=m.moe_router_topk,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_expert_capacity_factor=m.moe_expert_capacity_factor,
        moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_grouped_gemm=m.moe_grouped_gemm,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=m.bf16,
        fp16=m.fp16,
        add_bias_linear=False,  # Megatron's TP=1 MLP adds the bias in place on a reduce output (autograd error)
        attention_dropout=m.attention_dropout,
        hidden_dropout=m.hidden_dropout,
        use_cpu_initialization=False,  # per-rank expert seeds (CPU init gives every EP rank the same experts)
        deterministic_mode=args.training.deterministic,
        # Transformer Engine's FP8 only (an emulation component's own layers run --fp8-format with the local
        # implementation: Megatron sees no fp8)
        fp8=m.fp8_format if m.transformer_impl == "transformer_engine" else None,
        fp8_recipe=m.fp8_recipe if m.fp8_format and m.transformer_impl == "transformer_engine" else None,
        fp8_margin=m.fp8_margin,
        fp8_amax_history_len=m.fp8_amax_history_len,
        fp8_amax_compute_algo=m.fp8_amax_compute_algo,
        gradient_accumulation_fusion=False,
        variable_seq_lengths=False,
        batch_p2p_comm=not shares_one_peer(p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size),
    )


def shares_one_peer(pp_size: int, vp_size: int | None) -> bool:
    """Whether a pipeline rank's previous and next rank are the same peer in one p2p exchange: two pipeline
    ranks with virtual stages (the interleaved schedule's ring wraps, so rank 0's previous rank is rank 1).

    Megatron-Core's batched exchange (``batch_p2p_comm``, ``_batched_p2p_ops``) then posts the sends to that
    peer as [gradient to previous, activation to next] and the receives as [activation from previous,
    gradient from next]: ops between one pair in one direction match in the order posted
    (``torch.distributed.batch_isend_irecv``), so an exchange that carries both (more than two micro-batches)
    swaps activation and gradient (the loss diverges, and a localized replay, fed the logged
    tensors by direction, is no longer the run it replays). Megatron-LM refuses that combination
    (``validate_args``: the interleaved schedule without ``--overlap-p2p-communication`` needs PP > 2)
    and by default runs it unbatched. So does this: in the unbatched exchange (``_p2p_ops``) the even rank
    sends [to next, to previous] and the odd rank receives [from previous, from next] on the pipeline group
    (the same tensors in the same order: each rank is the other's previous and next), the reverse direction
    likewise on the default group, and every call completes before the next (no ``overlap_p2p_comm``). On
    GPU both groups are NCCL (``initialize_distributed``), and NCCL runs an unbatched send or receive on a
    two-rank communicator of its group, in order: only the two pipeline ranks take part."""
    return pp_size == 2 and vp_size is not None


def layer_spec(args: Args):
    """The layer spec: Megatron's local spec, or its Transformer Engine spec with ``--transformer-impl
    transformer_engine``; moe-ft's router/MoE subclasses plug in here: every
    extra argument group may adapt it (``customize_layer_spec``, ``megatron/training/extensions.py``)."""
    if args.model.transformer_impl == "transformer_engine":  # GPU; validated to import
        # optional dependency: this spec imports Transformer Engine (the [gpu] extra)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=args.model.num_experts,
                                                          moe_grouped_gemm=args.model.moe_grouped_gemm)
    else:
        spec = get_gpt_layer_local_spec(num_experts=args.model.num_experts,
                                        moe_grouped_gemm=args.model.moe_grouped_gemm)
    for component in extensions(args):
        spec = component.customize_layer_spec(spec)
    return spec


def build_gpt_model(args: Args, config: TransformerConfig | None = None, vp_stage: int | None = None) -> GPTModel:
    """This rank's pipeline stage of the GPT model (plain Megatron-Core module, not yet wrapped); with virtual
    pipeline stages, chunk ``vp_stage`` of it: Megatron-Core places the chunk's layers at their global
    positions (virtual stage ``v`` of pipeline rank ``r`` holds layers ``(v*PP + r)*L .. +L``, ``L`` layers
    per virtual stage), the embedding on the first chunk of the first rank, the output layer on the last
    chunk of the last rank."""
    config = config or transformer_config(args)
    vp = args.parallel.virtual_pipeline_model_parallel_size
    if (vp is None) != (vp_stage is None):
        raise ValueError(f"vp_stage={vp_stage} with virtual_pipeline_model_parallel_size={vp}: pass a chunk "
                         "index exactly when the model has virtual pipeline stages")
    first_chunk = vp_stage is None or vp_stage == 0
    last_chunk = vp_stage is None or vp_stage == vp - 1
    spec = layer_spec(args)
    if config.sequence_parallel and args.model.transformer_impl == "local":  # torch's norms refuse it
        spec = with_sequence_parallel_norms(spec, config, vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size_for(args),
        max_sequence_length=args.model.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage() and first_chunk,
        post_process=ps.is_pipeline_last_stage() and last_chunk,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
        vp_stage=vp_stage,
    )


@dataclass
class TrainState:
    """The objects a training step touches. ``model`` is the list of DDP-wrapped model chunks."""

    model: list
    optimizer: object
    scheduler: OptimizerParamScheduler
    config: TransformerConfig
    global_batch_size: int
    """Samples per iteration: saved with a checkpoint, whose data position is iteration x this."""
    run_id: str = ""
    """The run's identity (``Args.run_id``), saved with every checkpoint of this state."""


def build_train_state(args: Args) -> TrainState:
    config = transformer_config(args)
    vp = args.parallel.virtual_pipeline_model_parallel_size
    # Megatron-Core's schedule picker (get_forward_backward_func) and layout helpers read the virtual size
    # from parallel_state; initialize_model_parallel leaves it unset, so set it (None: plain 1F1B)
    ps.set_virtual_pipeline_model_parallel_world_size(vp)
    chunks = [_build_chunk(args, config, vp_stage) for vp_stage in ([None] if vp is None else range(vp))]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.parallel.use_distributed_optimizer,
    )
    # one DDP per chunk; as Megatron-LM, only the first chunk's buffers are bucketed (no overlap here anyway)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt,
                                     disable_bucketing=idx > 0) for idx, gpt in enumerate(chunks)]
    return _finish_train_state(args, config, model)


def _build_chunk(args: Args, config: TransformerConfig, vp_stage: int | None) -> GPTModel:
    gpt = build_gpt_model(args, config, vp_stage)
    if args.model.fp16 or args.model.bf16:
        # What Megatron-LM's Float16Module does in its constructor: every parameter and buffer in the
        # compute dtype (the parallel layers already are; norms and the position embedding are not). Done
        # in place rather than by wrapping, so the chunk's module stays the GPTModel (parameter names, and
        # so operators, are unchanged); its forward casts are no-ops here (token ids in, the loss is cast
        # to fp32 by the loss function, pipeline stages exchange ``pipeline_dtype`` tensors).
        gpt.to(config.params_dtype)
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    return gpt


def _finish_train_state(args: Args, config: TransformerConfig, model: list) -> TrainState:
    """One optimizer over every chunk, the schedule's callbacks and the LR/WD scheduler."""
    t = args.training
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        clip_grad=t.clip_grad,
        bf16=args.model.bf16,
        fp16=args.model.fp16,
        use_distributed_optimizer=args.parallel.use_distributed_optimizer,
        params_dtype=config.params_dtype,
        loss_scale=t.loss_scale,
        initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale,
        loss_scale_window=t.loss_scale_window,
        hysteresis=t.hysteresis,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    for component in extensions(args):  # e.g. FP8 state quantized from the masters (--fp8-emulation)
        component.after_optimizer_built(model, optimizer, args)
    # The schedules call these (Megatron-LM's training.py sets them the same way): without
    # finalize_model_grads there is no data-parallel gradient all-reduce and replicas drift apart.
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    # the interleaved schedule takes one no_sync per chunk; the plain one a single callable
    config.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
    # Megatron-Core's default use_checkpoint_opt_param_scheduler=True: its load_state_dict takes the state it
    # is given. --load and moe-ft's recovery give it the saved state, then the flags' values where
    # --override-opt-param-scheduler says so (resume_checks.take_flags_schedule); by default the two are
    # equal (checked at parsing for --load, before restoring for recovery: moe_ft/recovery/schedule.py).
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0 if t.lr_warmup_iters else t.lr, **flag_state(t))
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, config=config,
                      global_batch_size=t.global_batch_size, run_id=args.run_id)
