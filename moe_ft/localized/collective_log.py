"""The collective log: results of every collective on a group that spans pipeline stages during a train step,
so that a stage replaying alone takes them from the log instead of calling the collective (MoEvement §3.4).

Which collectives those are was enumerated with :class:`moe_ft.testing.collective_checker.CollectiveChecker`
on one ``train_step`` (``docs/localized.md``): with PP=4 the global grad-norm ``all_reduce`` of the optimizer's
clip (``MODEL_PARALLEL_GROUP``, ``clip_grads.get_grad_norm_fp32``) and the MoE aux-loss tracker reduce over
the pipeline group (``moe_utils.reduce_aux_losses_tracker_across_ranks``); with PP=2 x EP2 also the expert
grad-norm ``all_reduce`` over ``EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP``. Data-parallel gradient
reduction, the EP all-to-alls and the loss average stay within one stage. The seam below does not rely on
that list: it routes *every* tensor collective and logs those whose group spans stages.

:class:`CollectiveSeam` wraps ``torch.distributed``'s collectives (both ``torch.distributed.X`` and
``distributed_c10d.X``, so it composes with the checker) while installed. A call on a stage-spanning group
made on the recording thread is logged in call order per group: a group's members call its collectives in
the same order, so (iteration, group ranks, call index) names the same result on every member, and any
member that survived can serve it. Supported: ``all_reduce``, ``broadcast``, ``all_gather``,
``all_gather_into_tensor``, ``all_reduce_coalesced`` (every member gets the same result). Other collectives on
a stage-spanning group are logged as unsupported, and a replay that meets one raises naming it.
"""

from __future__ import annotations

import inspect
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from megatron.core import parallel_state as ps

from moe_ft import comm
from moe_ft.localized.log_store import LogUnavailable

OUTPUTS = {  # function → the arguments holding its result (same on every member of the group)
    "all_reduce": ("tensor",),
    "broadcast": ("tensor",),
    "all_gather": ("tensor_list",),
    "all_gather_into_tensor": ("output_tensor",),
    "all_reduce_coalesced": ("tensors",),
}
UNSUPPORTED = ("reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
               "reduce", "gather", "scatter", "_all_gather_base")
UNSUPPORTED_PREFIX = "unsupported:"


class _Done:
    """The work handle of a collective served from the log (already complete)."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _flat(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    return [t for v in value for t in _flat(v)]


class CollectiveSeam:
    """Wraps ``torch.distributed``'s collectives; routes calls on stage-spanning groups to the attached
    recorder (:class:`moe_ft.localized.upstream_log.LogRecorder`) and replay handler.

    ``stage_of``: global rank → pipeline stage of every rank of the job."""

    def __init__(self, stage_of: dict[int, int]) -> None:
        self.stage_of = dict(stage_of)
        self.recorder = None
        self.replay = None
        """A handler with ``active`` and ``collective(ranks, fn, outputs, call, spans)`` (``LogReplay``), or
        ``None``."""
        self._patches = comm.CollectivePatches()
        self._ranks: dict[int, tuple] = {}
        self._local = threading.local()

    @classmethod
    def gather_stages(cls) -> "CollectiveSeam":
        """Collective over every rank (host path): learn every rank's pipeline stage."""

        stages = comm.all_gather_object(ps.get_pipeline_model_parallel_rank())
        return cls({rank: stage for rank, stage in enumerate(stages)})

    # ------------------------------------------------------------------------------------- install
    def install(self) -> "CollectiveSeam":
        if self._patches:
            raise RuntimeError("CollectiveSeam is already installed")
        for name in (*OUTPUTS, *UNSUPPORTED):
            if hasattr(c10d, name):
                self._patches.patch(name, self._wrap(name, getattr(c10d, name)))
        return self

    def uninstall(self) -> None:
        self._patches.restore()

    # ------------------------------------------------------------------------------------- routing
    def group_ranks(self, group) -> tuple[int, ...]:
        if group is None or group is c10d.GroupMember.WORLD:
            return tuple(range(dist.get_world_size()))
        key = id(group)
        if key not in self._ranks:
            self._ranks[key] = (group, tuple(sorted(dist.get_process_group_ranks(group))))
        return self._ranks[key][1]

    def spans_stages(self, ranks: tuple[int, ...]) -> bool:
        return len({self.stage_of[r] for r in ranks}) > 1

    @staticmethod
    def _excluded(group) -> bool:
        return group is not None and group is comm.initialized_coordination_group()  # moe-ft's own host path

    def _wrap(self, name: str, orig):
        sig = inspect.signature(orig)

        def collective(*args, **kwargs):
            rec, replay = self.recorder, self.replay
            replay = replay if replay is not None and replay.active else None
            if getattr(self._local, "depth", 0) or (replay is None and (rec is None or not rec.active)):
                return orig(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            if self._excluded(group):
                return orig(*args, **kwargs)
            ranks = self.group_ranks(group)

            def call():
                self._local.depth = 1
                try:
                    return orig(*args, **kwargs)
                finally:
                    self._local.depth = 0

            spans = self.spans_stages(ranks)
            outputs = _flat([bound.arguments[a] for a in OUTPUTS[name]]) if name in OUTPUTS else []
            fn = name if name in OUTPUTS else UNSUPPORTED_PREFIX + name
            if replay is not None:
                work = replay.collective(ranks, fn, outputs, call, spans)
                if isinstance(work, _Done) and not bound.arguments.get("async_op"):
                    work = None  # what the synchronous collective returns
            else:
                work = call()
            if spans and rec is not None and rec.active:
                if work is not None and bound.arguments.get("async_op"):
                    work.wait()  # the result must be final before it is logged (none are async in 0.16.1)
                rec.record_collective(ranks, fn, outputs)
            return work

        collective.__name__ = name
        collective.__wrapped__ = orig
        return collective


def serve(fn: str, outputs: list[torch.Tensor], logged, where: str):
    """Copy a logged result into the call's output tensors (bitwise), or raise naming the mismatch."""
    if fn.startswith(UNSUPPORTED_PREFIX):
        raise LogUnavailable(f"{where}: {fn[len(UNSUPPORTED_PREFIX):]} on a group that spans pipeline stages "
                             "cannot be served from the collective log (each member's result differs): "
                             "replay globally (--ft-recovery-scope global)")
    if logged.fn != fn or len(logged.outputs) != len(outputs):
        raise LogUnavailable(f"{where}: the replay called {fn} with {len(outputs)} outputs where the log has "
                             f"{logged.fn} with {len(logged.outputs)}: the replay diverged from the logged "
                             "iteration; replay globally (--ft-recovery-scope global)")
    for out, src in zip(outputs, logged.outputs):
        if out.shape != src.shape or out.dtype != src.dtype:
            raise LogUnavailable(f"{where}: {fn} output {tuple(out.shape)} {out.dtype} does not match the logged "
                                 f"{tuple(src.shape)} {src.dtype}: the replay diverged; replay globally")
        with torch.no_grad():
            out.copy_(src)
    return _Done()
