"""Bad combinations of the fault-tolerance flags stop at parsing: exit 2 and one line naming the fix, before any
process group. Each combination here used to pass parsing and raise after it, on every rank, once the component
was built (at model build or after the first iteration): an exit 1, which ``moe-ft launch`` treats as a failure
and hands the rank to a spare that fails the same way (docs/launch.md, exit codes)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.training.arguments import parse_args  # noqa: E402
from tests._ft_helpers import tiny_model_flags  # noqa: E402

FLEXIBLE_EP2 = ["--moe-token-dispatcher-type", "flexible"]

# (layout, model flag overrides, world size, further flags, the error line after "error: ")
REFUSED = {
    "durable tier without a directory": (
        "single", {}, 1, ["--ft", "--ft-persist-interval", "2"],
        "--ft-persist-interval needs a durable directory: pass --ft-persist-dir or --save"),
    "CheckFree+ with virtual pipeline stages": (
        "pp4", {"num_layers": 8, "num_layers_per_virtual_pipeline_stage": 1}, 4, ["--ft", "--ft-checkfree-plus"],
        "--ft-checkfree-plus: CheckFree+ swaps and copies one model chunk per pipeline rank, got 2 (virtual pipeline "
        "stages): drop --num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size"),
    "optimizer recomputation with the distributed optimizer": (
        "dp2ep2", {}, 4, ["--ft", "--ft-policy", "selective", "--ft-optimizer-recompute"],
        "--ft-optimizer-recompute does not support --use-distributed-optimizer: the peer would hold one "
        "data-parallel shard of each expert and cannot rebuild its compute weights; drop one of the two flags"),
    "optimizer recomputation with FP8 weights": (
        "single", {"fp8_format": "e4m3"}, 1,
        ["--fp8-emulation", "--ft", "--ft-policy", "selective", "--ft-optimizer-recompute"],
        "--ft-optimizer-recompute does not support FP8 weights (--fp8-emulation)"),
    "bubble-aware snapshots without a pipeline": (
        "single", {}, 1, ["--ft", "--ft-snapshot-bubble-aware"],
        "--ft-snapshot-bubble-aware schedules snapshot copies into pipeline bubbles; this job has "
        "--pipeline-model-parallel-size 1 (no bubbles): drop the flag or use PP > 1"),
    "flexible: slots without replica counts": (
        "ep2", {}, 4, [*FLEXIBLE_EP2, "--ft-expert-slots", "3"],
        "--ft-expert-slots 3 without --ft-expert-replicas: the plan is standard EP (--num-experts 4 / EP size 2 slots "
        "per rank); pass --ft-expert-replicas to use other slot counts, or drop --ft-expert-slots"),
    "flexible: a count per expert": (
        "ep2", {}, 4, [*FLEXIBLE_EP2, "--ft-expert-replicas", "1", "1", "1"],
        "--ft-expert-replicas has 3 counts for 4 experts (--num-experts): give one count per expert"),
    "flexible: counts filling the slots": (
        "ep2", {}, 4, [*FLEXIBLE_EP2, "--ft-expert-replicas", "2", "2", "2", "2", "--ft-expert-slots", "2"],
        "--ft-expert-replicas sums to 8 but EP size 2 x --ft-expert-slots 2 = 4 slots; make them agree"),
    "flexible: a load per expert": (
        "ep2", {}, 4, [*FLEXIBLE_EP2, "--ft-expert-replicas", "auto", "--ft-expert-loads", "1", "2", "3"],
        "--ft-expert-loads has 3 values for 4 experts (--num-experts)"),
    "flexible: slots for the fault threshold": (
        "ep2", {}, 4, [*FLEXIBLE_EP2, "--ft-expert-replicas", "auto", "--ft-fault-threshold", "3"],
        "--ft-expert-replicas auto on 2 EP ranks (the nodes) with --ft-expert-slots 2 and --ft-fault-threshold 3 "
        "(f): 2 nodes x 2 slots = 4 slots cannot hold 4 experts x f=3 replicas = 12"),
    "flexible: no token dropping": (
        "ep2", {"moe_expert_capacity_factor": 1.0}, 4, FLEXIBLE_EP2,
        "--moe-token-dispatcher-type flexible never drops or pads tokens: drop --moe-expert-capacity-factor"),
    "flexible: no expert tensor parallelism": (
        "ep2", {"expert_tensor_parallel_size": 2}, 4, FLEXIBLE_EP2,
        "--moe-token-dispatcher-type flexible runs whole experts on one rank each, not expert tensor parallelism "
        "(got size 2): drop --expert-tensor-parallel-size"),
    "an exact minimum recovery level without determinism": (
        "single", {}, 1, ["--no-deterministic", "--ft", "--ft-min-recovery-level", "exact"],
        "--ft-min-recovery-level exact needs bitwise replays, but --no-deterministic lets kernels differ from run "
        "to run (a replayed iteration is then not bitwise): drop --no-deterministic, or pass "
        "--ft-min-recovery-level nondeterministic (or lower)"),
    "elastic without a fixed global batch": (
        "ep2", {"global_batch_size": None, "moe_token_dispatcher_type": "flexible"}, 4,
        ["--ft", "--ft-elastic"],
        "--ft-elastic keeps the global batch over a shrink or grow, so it must be fixed: pass --global-batch-size "
        "(e.g. 8, --micro-batch-size x the data-parallel size of this world)"),
}

# each refusal's neighbour that must still parse (world size, layout, overrides, flags)
ACCEPTED = {
    "durable tier in --save": ("single", {}, 1, ["--ft", "--ft-persist-interval", "2", "--save", "ckpt"]),
    "durable tier in --ft-persist-dir": ("single", {}, 1, ["--ft", "--ft-persist-interval", "2",
                                                           "--ft-persist-dir", "durable"]),
    "durable tier flags without --ft": ("single", {}, 1, ["--ft-persist-interval", "2"]),
    "durable tier without snapshots": ("single", {}, 1, ["--ft", "--ft-policy", "none", "--ft-persist-interval", "2"]),
    "CheckFree+ on four stages": ("pp4", {}, 4, ["--ft", "--ft-checkfree-plus"]),
    "optimizer recomputation": ("ep2", {}, 4, ["--ft", "--ft-policy", "selective", "--ft-optimizer-recompute"]),
    "FP8 emulation with selective": ("single", {"fp8_format": "e4m3"}, 1, ["--fp8-emulation", "--ft", "--ft-policy",
                                                                          "selective"]),
    "bubble-aware snapshots on two stages": ("pp2", {}, 4, ["--ft", "--ft-snapshot-bubble-aware"]),
    "no determinism, the default minimum level": ("single", {}, 1, ["--no-deterministic", "--ft"]),
    "no determinism, replays not bitwise accepted": ("single", {}, 1, ["--no-deterministic", "--ft",
                                                                       "--ft-min-recovery-level", "nondeterministic"]),
    "an exact minimum level, deterministic": ("single", {}, 1, ["--ft", "--ft-min-recovery-level", "exact"]),
    "elastic with a global batch": ("ep2", {"moe_token_dispatcher_type": "flexible"}, 4, ["--ft", "--ft-elastic"]),
    "flexible, standard EP": ("ep2", {"expert_tensor_parallel_size": 1}, 4, FLEXIBLE_EP2),
    "flexible, counts": ("ep2", {}, 4, [*FLEXIBLE_EP2, "--ft-expert-replicas", "2", "2", "2", "2",
                                        "--ft-expert-slots", "4"]),
    "flexible, auto": ("ep2", {}, 4, [*FLEXIBLE_EP2, "--ft-expert-replicas", "auto", "--ft-expert-loads", "1", "2",
                                      "3", "4", "--ft-fault-threshold", "2", "--ft-expert-slots", "4"]),
}

# the entry script's main for each argv in one interpreter (one Megatron import): [exit code, its stderr]
# (stderr goes to a real file: main registers faulthandler on it)
MAIN_EACH = """
import contextlib, json, os, sys, tempfile
root, cases = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, root)
import pretrain_gpt_moe
out = []
for world, argv in cases:
    os.environ["WORLD_SIZE"] = str(world)
    with tempfile.TemporaryFile("w+") as err:
        with contextlib.redirect_stderr(err):
            rc = pretrain_gpt_moe.main(argv)
        err.seek(0)
        out.append([rc, err.read()])
print(json.dumps(out))
"""


def _argv(layout, overrides, flags, data_prefix):
    return [*tiny_model_flags(layout, **overrides), *flags, "--data-path", data_prefix]


@pytest.mark.timeout(120)  # one subprocess importing Megatron (~5 s; its own limit is 90 s)
def test_bad_ft_combinations_stop_at_parsing_with_exit_2_and_one_line(data_prefix, tmp_path):
    cases = [(world, _argv(layout, overrides, flags, data_prefix))
             for layout, overrides, world, flags, _ in REFUSED.values()]
    env = dict(os.environ, RANK="0")
    proc = subprocess.run([sys.executable, "-c", MAIN_EACH, ROOT, json.dumps(cases)], capture_output=True, text=True,
                          timeout=90, env=env, cwd=tmp_path)  # the cwd: nothing written into the repository
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for (name, (*_, line)), (rc, stderr) in zip(REFUSED.items(), results):
        assert rc == 2, (name, rc, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {line}"), (name, stderr)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_the_valid_neighbours_still_parse(name, data_prefix, tmp_path, monkeypatch):
    import pretrain_gpt_moe

    monkeypatch.chdir(tmp_path)  # --save ckpt / --ft-persist-dir durable: relative, never created by parsing
    layout, overrides, world, flags = ACCEPTED[name]
    args = parse_args(_argv(layout, overrides, flags, data_prefix), world_size=world,
                      extra_groups=pretrain_gpt_moe.extra_argument_groups())
    assert args.extra["FTConfig"].ft == ("--ft" in flags)


def _model_args(**model):
    """The flags ``check_args`` reads, for layouts this machine cannot parse: ``--moe-grouped-gemm`` needs the
    CUDA ``grouped_gemm`` package (or Transformer Engine), which argument validation checks first."""
    base = dict(moe_grouped_gemm=True, transformer_impl="local", moe_expert_capacity_factor=None, fp8_format=None,
                moe_token_dispatcher_type="alltoall", num_experts=4)
    return SimpleNamespace(model=SimpleNamespace(**{**base, **model}),
                           parallel=SimpleNamespace(use_distributed_optimizer=False, pipeline_model_parallel_size=1,
                                                    tensor_model_parallel_size=1, expert_tensor_parallel_size=None,
                                                    expert_model_parallel_size=2,
                                                    num_layers_per_virtual_pipeline_stage=None,
                                                    virtual_pipeline_model_parallel_size=None),
                           training=SimpleNamespace(save=None), extra={})


def test_grouped_mlp_is_refused_by_the_recomputation_and_the_flexible_dispatcher():
    """GroupedMLP (``--moe-grouped-gemm``, local implementation) keeps a layer's experts in one weight: no
    expert's own optimizer state for the peer to replay, no MLP per replica for the flexible dispatcher. Both
    raised at build (``optim_recompute.main_params``, ``ElasticMoELayer``); now at parsing (``check_args``,
    whose ``ValueError`` the parser turns into the one line and exit 2)."""
    from moe_ft.config import FTConfig
    from moe_ft.elastic.config import ElasticConfig

    recompute = FTConfig.from_flags(ft=True, ft_policy="selective", ft_optimizer_recompute=True)
    with pytest.raises(ValueError, match=r"^--ft-optimizer-recompute replays each expert's own optimizer step, .*"
                                         r"drop --moe-grouped-gemm \(SequentialMLP experts\) or --ft-optimizer-recompute$"):
        recompute.check_args(_model_args())
    recompute.check_args(_model_args(transformer_impl="transformer_engine"))  # TEGroupedMLP: a weight per expert
    FTConfig.from_flags(ft=True, ft_policy="selective").check_args(_model_args())
    with pytest.raises(ValueError, match=r"^--moe-token-dispatcher-type flexible needs SequentialMLP experts \(one MLP "
                                         r"per replica\): drop --moe-grouped-gemm$"):
        ElasticConfig().check_args(_model_args(moe_token_dispatcher_type="flexible"))
    ElasticConfig().check_args(_model_args(moe_token_dispatcher_type="flexible", moe_grouped_gemm=False))
