"""Inputs of the ETTR model and simulator (MoEvement App. C "Inputs").

Four groups, one dataclass each: the model architecture, the parallel plan, the precision of each kind
of state, and the hardware (with the NCCL affine cost ``T(m, p) = α(p) + β(p)·m`` of MoEvement App. C).
:class:`RecoverySpec` holds the failure-handling constants the papers leave implicit (restart time).
:func:`config_from_dict` builds a :class:`SimConfig` from the JSON layout documented in
``docs/simulator.md`` and rejects unknown keys with the list of valid ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
MAX_INT = 2**53
"""Largest integer field value: the cost model computes in floats, exact up to here (a count beyond it is
a typo, and overflowed the arithmetic with a traceback)."""
_KINDS = {"int": "an integer", "float": "a finite number", "str": "a string", "bool": "true or false"}


def _fits(kind: str, value: Any) -> bool:
    if kind == "int":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)) <= MAX_INT
    if kind == "float":
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            return False
        try:
            return math.isfinite(float(value))
        except OverflowError:  # an integer too large for a float
            return False
    if kind == "str":
        return isinstance(value, str)
    return isinstance(value, bool)


def check_field_types(spec: Any, section: str) -> None:
    """``ValueError`` naming ``section.field`` for a scalar field whose value is not of its declared type:
    a string or ``null`` where a number belongs, ``1.5`` for a count, NaN or infinity (JSON's ``NaN``,
    ``Infinity``, ``1e400``), which every range check below would let through (comparisons with NaN are
    false) and the cost model turned into a traceback or a silent NaN."""
    for f in dataclasses.fields(spec):
        kind = str(f.type)
        value = getattr(spec, f.name)
        if kind.endswith(" | None"):
            if value is None:
                continue
            kind = kind.removesuffix(" | None")
        if kind in _KINDS and not _fits(kind, value):
            bound = " of at most 2**53" if kind == "int" and isinstance(value, numbers.Integral) else ""
            raise ValueError(f"{section}.{f.name} must be {_KINDS[kind]}{bound}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A GPT MoE decoder. Dense FFN layers come first (DeepSeek's ``first_k_dense``), then every
    ``moe_layer_interval``-th layer is MoE (MoE-LLaVa alternates dense and MoE layers)."""

    name: str = "model"
    num_layers: int  # transformer layers
    hidden_size: int
    ffn_hidden_size: int  # FFN width of the dense (non-MoE) layers
    moe_ffn_hidden_size: int  # FFN width of one routed (and one shared) expert
    num_experts: int  # routed experts per MoE layer
    top_k: int  # routed experts per token
    num_shared_experts: int = 0  # always-active experts, part of the layer's non-expert ("dense") operator
    vocab_size: int
    seq_length: int
    first_dense_layers: int = 0  # leading layers with a dense FFN instead of experts
    moe_layer_interval: int = 1  # after the leading dense layers, layer i is MoE iff i % interval == 0
    gated_ffn: bool = True  # SwiGLU: 3·h·f weights per FFN, else 2·h·f
    tie_embeddings: bool = False
    attention_params_per_layer: int | None = None  # default 4·h² (Q, K, V, O); set for GQA/MLA

    def __post_init__(self) -> None:
        check_field_types(self, "model")
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size", "num_experts",
                     "top_k", "vocab_size", "seq_length", "moe_layer_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"model.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if not 0 <= self.first_dense_layers < self.num_layers:
            raise ValueError("model.first_dense_layers must leave at least one MoE layer")

    def is_moe_layer(self, layer_idx: int) -> bool:
        rel = layer_idx - self.first_dense_layers
        return rel >= 0 and rel % self.moe_layer_interval == 0


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    """Megatron-style plan: ``world = tp·pp·dp``; experts are split over ``ep`` ranks taken from the
    data-parallel ranks, so each expert is replicated ``dp/ep`` times. MoEvement §5.1 writes
    (PP, DP, EP) with DP the *expert* data parallelism: its (12, 1, 8) is ``pp=12, dp=8, ep=8`` here."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    micro_batch_size: int  # sequences per micro-batch
    global_batch_size: int  # sequences per iteration (all data-parallel replicas)
    distributed_optimizer: bool = True  # ZeRO-1: master + optimizer sharded over data parallelism
    shard_snapshots: bool = True  # MoC §2.3.2 fully sharded checkpointing: replicas split the copy

    def __post_init__(self) -> None:
        check_field_types(self, "parallel")
        for name in ("tp", "pp", "dp", "ep", "micro_batch_size", "global_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide dp={self.dp} (experts live on DP ranks)")
        if self.global_batch_size % (self.micro_batch_size * self.dp):
            raise ValueError(
                f"parallel.global_batch_size={self.global_batch_size} must be a multiple of "
                f"micro_batch_size·dp = {self.micro_batch_size * self.dp}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)


@dataclass(frozen=True, kw_only=True)
class PrecisionSpec:
    """Bytes per parameter of each kind of state (MoEvement Table 7 names the five low-precision
    configurations; see :data:`PRECISIONS`). ``optimizer`` is Adam's ``exp_avg + exp_avg_sq``."""

    compute: str = "bf16"  # fp8 doubles the math rate (Hopper) and halves compute-weight bytes
    master: str = "fp32"
    optimizer: tuple[str, str] = ("fp32", "fp32")
    grad_reduce: str = "fp32"  # dtype of the data-parallel gradient reduction

    def __post_init__(self) -> None:
        check_field_types(self, "precision")
        for dtype in (self.compute, self.master, *self.optimizer, self.grad_reduce):
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
        if len(self.optimizer) != 2:
            raise ValueError("precision.optimizer must name two dtypes: [exp_avg, exp_avg_sq]")

    @property
    def compute_bytes(self) -> float:
        return DTYPE_BYTES[self.compute]

    @property
    def master_bytes(self) -> float:
        return DTYPE_BYTES[self.master]

    @property
    def optimizer_bytes(self) -> float:
        return DTYPE_BYTES[self.optimizer[0]] + DTYPE_BYTES[self.optimizer[1]]


PRECISIONS: dict[str, PrecisionSpec] = {
    "mixed": PrecisionSpec(compute="fp16", master="fp32", optimizer=("fp32", "fp32")),
    # MoEvement Table 7, rows top to bottom (compute / master / optimizer).
    "fp16-fp16-fp16": PrecisionSpec(compute="fp16", master="fp16", optimizer=("fp16", "fp16")),
    "fp8-fp32-fp32": PrecisionSpec(compute="fp8", master="fp32", optimizer=("fp32", "fp32")),
    "fp8-fp16-fp32": PrecisionSpec(compute="fp8", master="fp16", optimizer=("fp32", "fp32")),
    "fp8-fp16-fp8fp16": PrecisionSpec(compute="fp8", master="fp16", optimizer=("fp8", "fp16")),
    "fp8-fp8-fp8fp16": PrecisionSpec(compute="fp8", master="fp8", optimizer=("fp8", "fp16")),
}


@dataclass(frozen=True, kw_only=True)
class CollectiveCost:
    """NCCL affine model ``T(m) = alpha_s + beta_s_per_byte·m`` for one collective (MoEvement App. C),
    fitted for the group size it is used at. When absent, α and β are derived from link bandwidths."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        check_field_types(self, "hardware.collectives")
        if self.alpha_s < 0 or self.beta_s_per_byte < 0:
            raise ValueError("collective alpha_s and beta_s_per_byte must be >= 0")

    def time_s(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One homogeneous cluster. Bandwidths are *effective* bytes/s (what a copy achieves)."""

    name: str = "cluster"
    gpus_per_node: int = 8
    peak_flops_bf16: float  # dense FLOP/s at bf16/fp16
    peak_flops_fp8: float = 0.0  # 0: no FP8 math (A100); fp8 compute then runs at the bf16 rate
    mfu: float = 0.4  # achieved fraction of peak in the transformer math
    hbm_bytes: float = 80e9
    hbm_bandwidth: float = 2.0e12  # bytes/s, bounds the (memory-bound) optimizer step
    d2h_bandwidth: float  # GPU→pinned host copy per GPU (PCIe), bytes/s
    nvlink_bandwidth: float  # per GPU, intra-node, bytes/s
    network_bandwidth: float  # per GPU, inter-node (node NIC bandwidth / gpus_per_node), bytes/s
    storage_bandwidth: float = 5e9  # aggregate bandwidth of the whole job to durable storage, bytes/s
    host_s_per_byte: float = 1.5e-10
    """Training time lost per snapshot byte to the trainer process's own host work on it (checksum and
    store write on its threads, competing with the training thread): the T_ckpt that remains when the
    copy itself is hidden. Measured on one H100 with the store written by the trainer: 0.13-0.16 ms per MB
    (docs/benchmarks.md, "GPU (H100)"); 0 models a trainer that touches no snapshot byte."""
    host_s_per_snapshot: float = 0.0
    """Training time lost per snapshot whatever its size: the trainer's host work per point (issuing the
    copies, the hand-over, the other threads' Python competing with the training thread). With the copy into
    the arena hashed on the device it is most of the cost (docs/simulator.md, "The trainer's host work")."""
    collective_latency_s: float = 20e-6  # α of derived collectives
    collectives: Mapping[str, CollectiveCost] = field(default_factory=dict)  # overrides by name

    def __post_init__(self) -> None:
        check_field_types(self, "hardware")
        for name in ("gpus_per_node", "peak_flops_bf16", "d2h_bandwidth", "nvlink_bandwidth",
                     "network_bandwidth", "storage_bandwidth", "hbm_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware.{name} must be > 0, got {getattr(self, name)}")
        for name in ("host_s_per_byte", "host_s_per_snapshot"):
            if getattr(self, name) < 0:
                raise ValueError(f"hardware.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"hardware.mfu must be in (0, 1], got {self.mfu}")
        unknown = set(self.collectives) - set(COLLECTIVES)
        if unknown:
            raise ValueError(f"unknown collectives {sorted(unknown)}; expected some of {COLLECTIVES}")


COLLECTIVES = ("all_to_all", "all_reduce", "reduce_scatter", "all_gather", "p2p")


@dataclass(frozen=True, kw_only=True)
class RecoverySpec:
    """Failure-handling constants. ``restart_s`` (detect, replace the node, restart every process, rebuild
    all communicators, refill the pipeline) is MoC eq. 3's ``O_restart`` for a global restart;
    ``localized_restart_s`` is the same when only the failed data-parallel group restarts and the others
    pause (MoEvement §3.4). No paper reports them; the defaults are what MoEvement Table 3 implies for
    DeepSeek-MoE at 10-minute MTBF (time lost per failure beyond the reported recovery time: ≈50 s for
    CheckFreq and Gemini, ≈15 s for MoEvement; derivation in docs/simulator.md)."""

    restart_s: float = 50.0
    localized_restart_s: float = 15.0
    inprocess_detect_s: float = 10.0
    """``moe-ft launch``: a lost node is declared after its agent's heartbeat stood still this long (the
    launcher's ``--node-timeout`` default)."""
    inprocess_reform_s: float = 2.0
    """``moe-ft launch``: from the lost node's declaration to training again (the spares take the ranks, every
    rank forms the new attempt's process groups and rebuilds its model; measured 0.3–0.7 s on 4 CPU ranks,
    an assumption for NCCL at scale)."""
    replicas: int = 2  # peer copies of each in-memory snapshot (MoEvement §4, r = 2)
    frozen_cost: float = 1.0
    """A frozen operator's share of an active one's replay cost, as the runtime replays: it computes the frozen
    operators' weight gradients and drops them (docs/recovery.md), so 1."""
    paper_frozen_cost: float = 2.0 / 3.0
    """The same in MoEvement's model (``sparse:localized=paper``): forward and input gradient, no weight
    gradient (§3.3's "≈33 %" saving)."""
    sync_overlap: float = 0.5  # share of the DP gradient sync hidden behind the backward pass

    def __post_init__(self) -> None:
        check_field_types(self, "recovery")
        if min(self.restart_s, self.localized_restart_s, self.inprocess_detect_s, self.inprocess_reform_s) < 0:
            raise ValueError("recovery.restart_s, localized_restart_s, inprocess_detect_s and inprocess_reform_s "
                             "must be >= 0")
        if self.replicas < 0:
            raise ValueError("recovery.replicas must be >= 0")
        if not 0 < self.frozen_cost <= 1 or not 0 < self.paper_frozen_cost <= 1 or not 0 <= self.sync_overlap <= 1:
            raise ValueError("recovery.frozen_cost and paper_frozen_cost must be in (0, 1] and sync_overlap in [0, 1]")


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Everything the cost model needs. ``name`` labels outputs."""

    name: str = "custom"
    model: ModelSpec
    parallel: ParallelSpec
    precision: PrecisionSpec = field(default_factory=PrecisionSpec)
    hardware: HardwareSpec
    recovery: RecoverySpec = field(default_factory=RecoverySpec)

    def __post_init__(self) -> None:
        check_field_types(self, "config")
        m, p = self.model, self.parallel
        if p.pp > m.num_layers:
            raise ValueError(f"parallel.pp={p.pp} exceeds model.num_layers={m.num_layers}: a stage would be empty")
        if m.num_experts % p.ep:
            raise ValueError(f"parallel.ep={p.ep} must divide model.num_experts={m.num_experts}")
        if p.tp > self.hardware.gpus_per_node:
            raise ValueError("parallel.tp must fit in one node (tp <= hardware.gpus_per_node)")


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} in {where}; valid keys: {sorted(names)}")
    try:
        return cls(**data)
    except TypeError as exc:  # missing required fields
        raise ValueError(f"{where}: {exc}") from None


def config_from_dict(data: Mapping[str, Any]) -> SimConfig:
    """Build a :class:`SimConfig` from the JSON layout of ``docs/simulator.md``.

    ``precision`` may be a name from :data:`PRECISIONS` or an object; ``hardware.collectives`` maps a
    collective name to ``{"alpha_s": …, "beta_s_per_byte": …}``.
    """
    data = dict(data)
    for key in ("model", "parallel", "hardware"):
        if key not in data:
            raise ValueError(f"config needs a {key!r} section")
    prec = data.get("precision", "mixed")
    if isinstance(prec, str):
        if prec not in PRECISIONS:
            raise ValueError(f"unknown precision {prec!r}; expected one of {sorted(PRECISIONS)} or an object")
        precision = PRECISIONS[prec]
    else:
        prec = dict(prec)
        if "optimizer" in prec:
            prec["optimizer"] = tuple(prec["optimizer"])
        precision = _build(PrecisionSpec, prec, "precision")
    hw = dict(data["hardware"])
    hw["collectives"] = {
        name: _build(CollectiveCost, cost, f"hardware.collectives.{name}")
        for name, cost in dict(hw.get("collectives", {})).items()
    }
    allowed = {"name", "model", "parallel", "precision", "hardware", "recovery"}
    if set(data) - allowed:
        raise ValueError(f"unknown top-level key(s) {sorted(set(data) - allowed)}; valid: {sorted(allowed)}")
    return SimConfig(
        name=data.get("name", "custom"),
        model=_build(ModelSpec, data["model"], "model"),
        parallel=_build(ParallelSpec, data["parallel"], "parallel"),
        precision=precision,
        hardware=_build(HardwareSpec, hw, "hardware"),
        recovery=_build(RecoverySpec, data.get("recovery", {}), "recovery"),
    )


OVERRIDABLE = ("model", "parallel", "precision", "hardware", "recovery")


def with_overrides(cfg: SimConfig, items: list[str]) -> SimConfig:
    """``cfg`` with ``SECTION.FIELD=VALUE`` items applied in order (``moe-ft simulate/plan --set``; VALUE is
    JSON: a number, ``true``, a quoted string, a list), each section validated again as a config file is."""
    for item in items:
        name, sep, text = item.partition("=")
        section, dot, key = name.strip().partition(".")
        if not sep or not dot or section not in OVERRIDABLE:
            raise ValueError(f"--set {item!r}: expected SECTION.FIELD=VALUE with SECTION one of "
                             f"{', '.join(OVERRIDABLE)} (e.g. hardware.host_s_per_snapshot=0.016)")
        spec = getattr(cfg, section)
        fields = sorted(f.name for f in dataclasses.fields(spec) if f.name != "collectives")
        if key not in fields:
            raise ValueError(f"--set {item!r}: {section} has no field {key!r}; its fields: {', '.join(fields)}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"--set {item!r}: the value must be JSON (a number, true/false, a \"quoted\" "
                             "string, a list)") from None
        if isinstance(value, list):
            value = tuple(value)
        try:
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(spec, **{key: value})})
        except TypeError as exc:
            raise ValueError(f"--set {item!r}: {exc}") from None
    return cfg


def load_config(path: str) -> SimConfig:
    """Read a JSON config file (format in ``docs/simulator.md``)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read config {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"config {path!r} is not valid JSON: {exc}") from None
    return config_from_dict(data)
