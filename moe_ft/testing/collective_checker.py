"""A checker for the communication rule (``docs/communication.md``): records every ``torch.distributed``
collective — the function, the device of every tensor handed to it, the group, the caller — and judges the
calls our code makes.

Groups are **host** (created with ``backend="gloo"`` while the checker was installed — the coordination
group, Megatron's ``*_GLOO`` groups, the replication transport's group — or marked with :meth:`mark_host`) or
**accelerator** (every other group, and the default group): on a GPU cluster those are NCCL.

On a CPU-only run every tensor is a host tensor, model tensors included, so the device of a tensor cannot
tell whether the call would put a host tensor on NCCL. The checker therefore judges the *path*:

* a call whose caller (innermost frame outside ``torch``) is ``moe_ft/comm.py`` or
  ``megatron/training/collectives.py`` took the host path (its group must be host, its tensors on the CPU)
  or the device path (its tensors must be on ``comm.device_for(group)``, which is where the path puts them);
* a call made directly by our code (``moe_ft/``, ``megatron/training/``, ``pretrain_gpt_moe.py``) on an
  accelerator group is a violation when any tensor handed to it is on the CPU (on a CPU run: always) — the
  bug that fails with NCCL — and so is any object collective (pickled host objects) on an accelerator group;
  tensor-free calls (``barrier``) are recorded and allowed (NCCL implements them on the current device);
* calls from libraries (Megatron-Core's schedules, DDP, optimizer) are recorded with the innermost frame of
  our code that led to them, not judged: their tensors are the model's, on the device on a GPU run.

Install it before the process groups are created (a wrapper worker script: ``tests/_workers_comm.py``), so
that it sees which groups are gloo.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron.training import collectives
from moe_ft import comm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUR_PATHS = (os.path.join(ROOT, "moe_ft") + os.sep, os.path.join(ROOT, "megatron", "training") + os.sep,
             os.path.join(ROOT, "pretrain_gpt_moe.py"))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS = os.path.abspath(__file__)
_TESTING_DIR = os.path.dirname(_THIS) + os.sep
# seams that only route a call to torch (the caller above them is the one that chose group and device)
_ROUTING = tuple(os.path.join(os.path.dirname(os.path.dirname(_THIS)), "localized", name)
                 for name in ("collective_log.py", "log_replay.py"))

OBJECT_FNS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
              "send_object_list", "recv_object_list")
TENSORLESS_FNS = ("barrier", "monitored_barrier")
TENSOR_FNS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "_all_gather_base",
              "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
              "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
              "all_reduce_coalesced", "all_gather_coalesced")
COLLECTIVES = tuple(n for n in TENSOR_FNS + OBJECT_FNS + TENSORLESS_FNS if hasattr(c10d, n))


class CommRuleViolation(AssertionError):
    """Raised by :meth:`CollectiveChecker.assert_clean` (or at the call, with ``strict=True``)."""


@dataclass
class CallRecord:
    fn: str
    group: str
    ranks: list[int]
    kind: str
    """``host`` or ``accelerator``."""
    devices: list[str]
    origin: str
    """``comm`` (through ``moe_ft/comm.py`` or ``megatron/training/collectives.py``), ``ours`` (our code,
    directly) or ``library``."""
    caller: str
    """``file:line function`` of the innermost frame outside ``torch``."""
    site: str
    """The innermost frame of our code outside the comm modules (where the call comes from), or ``""``."""
    violation: str = ""
    rank: int = -1


def _tensors(value, out: list) -> list:
    if torch.is_tensor(value):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, c10d.P2POp):
        out.append(value.tensor)
    return out


def _short(path: str) -> str:
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


@dataclass
class CollectiveChecker:
    """Context manager wrapping ``torch.distributed``'s collectives (see the module docstring).

    ``our_paths``: path prefixes of "our code"; ``log_path``: stream the judged records (origin ``comm`` or
    ``ours``) there as JSON lines as they happen (a SIGKILLed worker keeps what it did); ``strict``: raise at the
    violating call instead of recording it."""

    our_paths: tuple[str, ...] = OUR_PATHS
    log_path: str = ""
    strict: bool = False
    records: list[CallRecord] = field(default_factory=list)
    library_counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._host: dict = {}
        self._patches = comm.CollectivePatches()
        self._local = threading.local()
        self._sigs: dict = {}
        self._log = None
        self._lock = threading.Lock()

        self._comm_files = (os.path.abspath(comm.__file__), os.path.abspath(collectives.__file__))

    # ------------------------------------------------------------------------------------------ install
    def install(self) -> "CollectiveChecker":
        if self._patches:
            raise RuntimeError("CollectiveChecker is already installed")
        if self.log_path:
            os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
            self._log = open(self.log_path, "a", buffering=1)
        for name in COLLECTIVES:
            self._patches.patch(name, self._wrap(name, getattr(c10d, name)))
        self._patches.patch("new_group", self._wrap_new_group(c10d.new_group))
        return self

    def uninstall(self) -> None:
        self._patches.restore()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "CollectiveChecker":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def mark_host(self, group) -> None:
        self._host[group] = True

    def is_host(self, group) -> bool:
        if group is None or group is c10d.GroupMember.WORLD:
            return False

        return group in self._host or group is comm.initialized_coordination_group()

    # ------------------------------------------------------------------------------------------ wrappers
    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _wrap_new_group(self, orig):
        @functools.wraps(orig)
        def new_group(*args, **kwargs):
            self._local.depth = self._depth() + 1
            try:
                group = orig(*args, **kwargs)
            finally:
                self._local.depth -= 1
            backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
            if isinstance(group, dist.ProcessGroup) and backend is not None and "gloo" in str(backend).lower():
                self._host[group] = True
            return group

        return new_group

    def _wrap(self, name: str, orig):
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def collective(*args, **kwargs):
            if self._depth():  # inside another wrapped call (all_gather_object -> all_gather): not a new call
                return orig(*args, **kwargs)
            self._local.depth = 1
            try:
                self._observe(name, sig, args, kwargs)
                return orig(*args, **kwargs)
            finally:
                self._local.depth = 0

        return collective

    # ------------------------------------------------------------------------------------------ judging
    def _frames(self):
        frame = sys._getframe(1)
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if not path.startswith(_TORCH_DIR) and path != _THIS and path not in _ROUTING:
                yield frame, path
            frame = frame.f_back

    def _is_ours(self, path: str) -> bool:
        return path.startswith(self.our_paths) and not path.startswith(_TESTING_DIR) and path not in self._comm_files

    def _where(self) -> tuple[str, str, str]:
        """(origin, caller, site) of the call being observed."""
        frames = self._frames()
        first = next(frames, None)
        if first is None:
            return "library", "?", ""
        where = lambda f, p: f"{_short(p)}:{f.f_lineno} {f.f_code.co_name}"  # noqa: E731
        frame, path = first
        caller = where(frame, path)
        origin = "comm" if path in self._comm_files else "ours" if self._is_ours(path) else "library"
        if origin == "ours":
            return origin, caller, caller
        site = next((where(f, p) for f, p in frames if self._is_ours(p)), "")
        return origin, caller, site

    def _group_of(self, name: str, sig, args, kwargs):
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs.get("p2p_op_list", [])
            return ops[0].group if ops else None
        try:
            bound = sig.bind_partial(*args, **kwargs)
        except TypeError:
            return kwargs.get("group")
        return bound.arguments.get("group")

    def _describe(self, group) -> tuple[str, list[int]]:
        if group is None or group is c10d.GroupMember.WORLD:
            return "WORLD", list(range(dist.get_world_size())) if dist.is_initialized() else []
        try:
            ranks = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):
            ranks = []
        return getattr(group, "group_desc", "") or f"group {getattr(group, 'group_name', '?')}", ranks

    def _observe(self, name: str, sig, args, kwargs) -> None:
        group = self._group_of(name, sig, args, kwargs)
        origin, caller, site = self._where()
        if origin == "library":
            key = f"{name} from {caller.split(':')[0]}"
            self.library_counts[key] = self.library_counts.get(key, 0) + 1
        tensors = [] if name in OBJECT_FNS else _tensors(list(args) + list(kwargs.values()), [])
        kind = "host" if self.is_host(group) else "accelerator"
        desc, ranks = self._describe(group)
        rec = CallRecord(fn=name, group=desc, ranks=ranks, kind=kind, devices=[str(t.device) for t in tensors],
                         origin=origin, caller=caller, site=site,
                         rank=dist.get_rank() if dist.is_initialized() else -1)
        rec.violation = self._judge(rec, group, tensors)
        with self._lock:
            self.records.append(rec)
            if self._log is not None and origin != "library":
                self._log.write(json.dumps(asdict(rec)) + "\n")
        if rec.violation and self.strict:
            raise CommRuleViolation(self._format(rec))

    def _judge(self, rec: CallRecord, group, tensors) -> str:
        if rec.origin == "library":
            return ""
        host_tensors = [t for t in tensors if t.device.type == "cpu"]
        if rec.kind == "host":
            if len(host_tensors) != len(tensors):
                return (f"device tensor ({', '.join(rec.devices)}) on host group {rec.group}: device tensors go "
                        "through the device path on an accelerator group")
            return ""
        if rec.fn in OBJECT_FNS:
            return (f"object collective {rec.fn} on accelerator group {rec.group}: host objects go over "
                    "moe_ft.comm.all_gather_object / broadcast_object (the coordination gloo group)")
        if rec.origin == "comm":
            device = comm.device_for(group)
            wrong = [str(t.device) for t in tensors if not comm.on_device(t, device)]
            return f"comm device path handed tensors on {wrong} to {rec.group} (device {device})" if wrong else ""
        if host_tensors:
            return (f"host tensor meets accelerator group {rec.group} in a raw {rec.fn}: use moe_ft.comm's host path "
                    "(coordination gloo group) or its device path (tensors on comm.device_for(group))")
        return ""

    # ------------------------------------------------------------------------------------------ results
    @property
    def violations(self) -> list[CallRecord]:
        return [r for r in self.records if r.violation]

    @staticmethod
    def _format(rec: CallRecord) -> str:
        via = f" (from {rec.site})" if rec.site and rec.site != rec.caller else ""
        return f"{rec.fn} at {rec.caller}{via} on {rec.group} [{rec.kind}]: {rec.violation}"

    def assert_clean(self) -> None:
        bad = self.violations
        if bad:
            raise CommRuleViolation(f"{len(bad)} collective(s) break the communication rule:\n"
                                    + "\n".join(self._format(r) for r in bad))

    def summary(self) -> dict:
        """Counts per (function, kind, origin, caller) of judged calls, library counts, and the violations."""
        judged: dict[str, int] = {}
        for r in self.records:
            if r.origin != "library":
                key = f"{r.fn} [{r.kind}] {r.origin} {r.site or r.caller}"
                judged[key] = judged.get(key, 0) + 1
        return {"judged": judged, "library": dict(self.library_counts),
                "violations": [self._format(r) for r in self.violations]}


def read_logs(paths) -> list[dict]:
    """The records of several workers' ``log_path`` files (JSON lines)."""
    out = []
    for path in paths:
        with open(path) as f:
            out.extend(json.loads(line) for line in f if line.strip())
    return out
