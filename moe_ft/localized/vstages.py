"""Which virtual pipeline stage made a p2p send of Megatron-Core's interleaved 1F1B schedule.

With virtual pipeline stages (``--num-layers-per-virtual-pipeline-stage``) a pipeline rank holds several
model chunks, and ``P2PCommunicator._communicate`` (the seam upstream logging captures at, MoEvement §3.4)
does not see which chunk a tensor belongs to. The schedule fixes it, though: Megatron-Core 0.16.1's
``get_schedule_table(M, C, G)`` runs forward virtual micro-batch ``k`` on chunk ``(k // G) % C`` when the
group size ``G`` (``microbatch_group_size_per_vp_stage``, the pipeline size by default) divides the ``M``
micro-batches, and backward virtual micro-batch ``k`` on chunk ``C - 1 - (k // G) % C``. Every forward step
sends its output downstream once, except the last chunk of the last pipeline rank (the loss), and every
backward step sends its input gradient upstream once, except the first chunk of the first rank. So the
``n``-th non-empty send in a direction of one schedule call identifies the chunk — on the sender by counting
its sends, on a log-fed receiver by counting what it took from the log — without copying the schedule.

Virtual stages are numbered as Megatron numbers them: chunk ``c`` of pipeline rank ``r`` is ``c * PP + r``.
"""

from __future__ import annotations

from moe_ft.localized.log_store import BWD, FWD


def sending_chunk(*, pp_rank: int, pp_size: int, num_chunks: int, group_size: int, direction: str,
                  send_idx: int) -> int:
    """Chunk of pipeline rank ``pp_rank`` that makes its ``send_idx``-th (0-based) non-empty ``direction``
    send in one call of the interleaved schedule (module docstring; needs ``group_size`` | micro-batches)."""
    if direction not in (FWD, BWD):
        raise ValueError(f"direction must be {FWD!r} or {BWD!r}, got {direction!r}")
    if not (0 <= pp_rank < pp_size and num_chunks >= 1 and group_size >= 1 and send_idx >= 0):
        raise ValueError(f"bad schedule position: pp_rank {pp_rank}, pp_size {pp_size}, chunks {num_chunks}, "
                         f"group {group_size}, send {send_idx}")
    if direction == FWD:
        order = [c for c in range(num_chunks) if not (pp_rank == pp_size - 1 and c == num_chunks - 1)]
    else:
        order = [c for c in reversed(range(num_chunks)) if not (pp_rank == 0 and c == 0)]
    if not order:
        raise ValueError(f"pipeline rank {pp_rank} makes no {direction} sends with {num_chunks} chunk(s)")
    return order[(send_idx % (group_size * len(order))) // group_size]


def sending_vstage(*, pp_rank: int, pp_size: int, num_chunks: int, group_size: int, direction: str,
                   send_idx: int) -> int:
    """Virtual stage (``chunk * PP + pp_rank``) of that send."""
    chunk = sending_chunk(pp_rank=pp_rank, pp_size=pp_size, num_chunks=num_chunks, group_size=group_size,
                          direction=direction, send_idx=send_idx)
    return chunk * pp_size + pp_rank


def comm_layout(comm) -> tuple[int, int, int] | None:
    """``(pp_size, num_chunks, group_size)`` of a ``P2PCommunicator`` of the interleaved schedule, or ``None``
    with one chunk per rank."""
    vp = comm.virtual_pipeline_model_parallel_size  # Megatron's communicator copies it from the config
    if vp in (None, 1):
        return None
    pp_size = comm.pp_group.size()
    return pp_size, vp, getattr(comm.config, "microbatch_group_size_per_vp_stage", None) or pp_size
