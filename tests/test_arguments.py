"""Flags map onto config dataclasses; bad flags stop with one actionable line before any process group."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.training.arguments import ArgumentError, parse_args  # noqa: E402
from tests._ft_helpers import tiny_model_flags, torchrun  # noqa: E402


def test_flags_map_to_dataclasses(data_prefix):
    args = parse_args(["--num-layers", "4", "--hidden-size", "32", "--num-experts", "8", "--moe-router-topk", "2",
                       "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--micro-batch-size", "1", "--global-batch-size", "4", "--split", "90", "9", "1",
                       "--use-distributed-optimizer", "--data-path", data_prefix], world_size=4)
    assert args.model.num_layers == 4 and args.model.ffn_hidden_size == 128
    assert args.parallel.use_distributed_optimizer and args.data.split == ["90", "9", "1"]
    assert args.data_parallel_size == 2 and args.num_microbatches == 2
    assert args.training.lr_decay_iters == args.training.train_iters


@pytest.mark.parametrize("flags,world,message", [
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2, "must be divisible by --expert-model"),
    (["--pipeline-model-parallel-size", "3"], 4, "world size 4 must be divisible"),
    (["--expert-model-parallel-size", "4", "--num-experts", "4"], 2, "ranks per stage must be divisible"),
    (["--global-batch-size", "3"], 2, "--global-batch-size 3 must be a positive multiple"),
    (["--global-batch-size", "0"], 2, "--global-batch-size 0 must be a positive multiple"),
    (["--global-batch-size", "-4"], 2, "--global-batch-size -4 must be a positive multiple"),
    (["--moe-grouped-gemm"], 1, "needs the grouped_gemm package"),
    (["--pipeline-model-parallel-size", "2", "--global-batch-size", "2", "--micro-batch-size", "1"], 4,
     "pipeline parallelism needs at least 2 micro-batches"),
    (["--moe-router-topk", "5"], 1, "exceeds --num-experts"),
    (["--bf16", "--fp16"], 1, "exclusive"),
    (["--save-interval", "5"], 1, "--save-interval needs --save"),
    (["--eval-interval", "2", "--eval-iters", "0"], 1, "--eval-interval 2 needs --eval-iters >= 1, got 0"),
    (["--tensor-model-parallel-size", "2"], 2, "needs --sequence-parallel"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--vocab-size", "301"], 2,
     "--vocab-size 301 must be divisible by --tensor-model-parallel-size 2: pass --vocab-size 302"),
    (["--moe-token-dispatcher-type", "flexible", "--use-distributed-optimizer", "--save", "ckpt"], 1,
     "need the plain optimizer"),
    # the LR schedule: Megatron-Core's scheduler asserts these on every rank after the model is built
    (["--lr", "1e-4"], 1, r"--lr 0.0001 is below --min-lr 0.0003 \(its default is 0.0003\): pass --min-lr 0.0001"),
    (["--min-lr=-1e-5"], 1, "--min-lr must be >= 0"),
    (["--lr-decay-iters", "0"], 1, "--lr-decay-iters must be positive, got 0"),
    (["--lr-warmup-iters", "-1"], 1, "--lr-warmup-iters must be >= 0, got -1"),
    (["--lr-decay-style", "constant", "--lr-warmup-iters", "100"], 1,
     "--lr-warmup-iters 100 must be smaller than the decay iterations 100"),
    # the two choices of the LR-schedule rule apply to --ft recovery too, not only to --load
    (["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"], 1, "are exclusive; pass one of them"),
])
def test_bad_flags(flags, world, message, data_prefix):
    with pytest.raises(ArgumentError, match=message):
        parse_args([*flags, "--data-path", data_prefix], world_size=world)


def test_missing_data_path_message():
    with pytest.raises(ArgumentError, match="preprocess_data.py"):
        parse_args([], world_size=1)


@pytest.mark.timeout(120)  # a subprocess importing Megatron (~5 s; its own limit is 60 s)
@pytest.mark.parametrize("flags, line", [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], "error: --num-experts 6 must be divisible"),
    # a Megatron-LM flag moe-ft does not take: argparse printed its usage (116 lines) before "unrecognized"
    (["--train-samples", "800"], "error: --train-samples (Megatron-LM) is not supported here: pass --train-iters"),
    (["--no-such-flag"], "error: unrecognized arguments: --no-such-flag (--help lists the flags)"),
])
def test_entry_script_one_line_error_without_process_group(tmp_path, flags, line):
    env = dict(os.environ, WORLD_SIZE="4", RANK="0")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt_moe.py"), *flags, "--data-path",
                           str(tmp_path / "none")], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), proc.stderr[-2000:]


@pytest.mark.parametrize("flags, message", [
    (["--train-samples", "800"], "pass --train-iters"),
    (["--lr-warmup-samples=80"], "pass --lr-warmup-iters"),
    (["--lr-decay-samples", "800"], "pass --lr-decay-iters"),
    (["--lr-warmup-fraction", "0.1"], "pass --lr-warmup-iters"),
    (["--rampup-batch-size", "2", "2", "100"], "the global batch size is fixed"),
    (["--exit-interval", "5"], "pass --train-iters N"),
    (["--exit-duration-in-mins", "60"], "bound the run with --train-iters"),
    (["--exit-signal-handler"], "keep the progress with --save-interval"),
    (["--skip-train"], "evaluation runs inside training"),
    (["--finetune"], "--load CKPT --no-load-optim --no-load-rng loads the model alone"),
    (["--mock-data"], "tools/preprocess_data.py"),
])
def test_megatron_lm_flags_without_support_are_named_with_their_replacement(flags, message, data_prefix):
    """Each flag stops parsing with one line that names it and what to pass instead."""
    name = flags[0].partition("=")[0]
    with pytest.raises(ArgumentError, match=rf"^{name} \(Megatron-LM\) is not supported here: .*{message}"):
        parse_args([*flags, "--data-path", data_prefix], world_size=1)


def test_argparse_errors_are_one_line(data_prefix):
    """A value argparse refuses (a choice it does not have, a number it cannot read) is one
    :class:`ArgumentError` line, not argparse's usage and exit; Megatron-LM's WSD schedule says what to use."""
    with pytest.raises(ArgumentError, match="^--lr-decay-style WSD: there is no WSD schedule here; pass constant, "
                                            "linear, cosine or inverse-square-root$"):
        parse_args(["--lr-decay-style", "WSD", "--data-path", data_prefix], world_size=1)
    with pytest.raises(ArgumentError, match=r"^argument --lr-decay-style: invalid choice: 'step'.*\(--help lists"):
        parse_args(["--lr-decay-style", "step", "--data-path", data_prefix], world_size=1)
    with pytest.raises(ArgumentError, match=r"^argument --train-iters: invalid int value: 'ten'"):
        parse_args(["--train-iters", "ten", "--data-path", data_prefix], world_size=1)


def test_fp8_needs_transformer_engine(data_prefix):
    with pytest.raises(ArgumentError, match="--fp8-format needs --transformer-impl transformer_engine"):
        parse_args(["--fp8-format", "hybrid", "--data-path", data_prefix], world_size=1)
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ArgumentError, match="needs Transformer Engine"):
            parse_args(["--transformer-impl", "transformer_engine", "--data-path", data_prefix], world_size=1)


def test_elastic_restart_rederives_expert_parallel_before_validation(data_prefix, capsys):
    """``--ft-elastic`` on a world smaller than the flag's EP size: the extra group's ``adjust_parallel`` runs
    before Megatron's validation (which would refuse EP 4 on 2 ranks) and says what it changed."""
    import pretrain_gpt_moe

    flags = [*tiny_model_flags("ep4", seq_length=None, micro_batch_size=1, moe_token_dispatcher_type="flexible"),
             "--ft", "--ft-elastic", "--ft-expert-slots", "2", "--data-path", data_prefix]
    args = parse_args(flags, world_size=2, extra_groups=pretrain_gpt_moe.extra_argument_groups())
    assert args.parallel.expert_model_parallel_size == 2
    assert "expert-model-parallel-size 4 -> 2" in capsys.readouterr().out
    with pytest.raises(ArgumentError, match="expert"):  # without --ft-elastic the flag's EP size stands
        parse_args([f for f in flags if f not in ("--ft-elastic",)], world_size=2,
                   extra_groups=pretrain_gpt_moe.extra_argument_groups())


def test_elastic_takes_pipeline_parallelism_and_the_pipeline_first_rank_order(data_prefix):
    """``--ft-elastic`` with PP=2 parses (one model chunk per rank; virtual stages and the distributed
    optimizer with in-run rebalancing are refused with the flag to drop), and ``--use-tp-pp-dp-mapping`` is refused where
    Megatron-Core would refuse its order (experts with another data-parallel size than the dense layers)."""
    import pretrain_gpt_moe

    groups = pretrain_gpt_moe.extra_argument_groups()
    flags = ["--num-layers", "2", "--num-experts", "4", "--moe-token-dispatcher-type", "flexible",
             "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--micro-batch-size", "2",
             "--ft", "--ft-elastic", "--ft-expert-slots", "4", "--data-path", data_prefix]
    args = parse_args([*flags, "--use-tp-pp-dp-mapping"], world_size=4, extra_groups=groups)
    assert args.parallel.use_tp_pp_dp_mapping and args.parallel.pipeline_model_parallel_size == 2
    with pytest.raises(ArgumentError, match="one model chunk per pipeline rank"):
        parse_args([*flags, "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"], world_size=4,
                   extra_groups=groups)
    args = parse_args([*flags, "--use-distributed-optimizer"], world_size=4, extra_groups=groups)
    assert args.parallel.use_distributed_optimizer  # shards re-assembled on the new world (moe_ft/state/shards.py)
    with pytest.raises(ArgumentError, match="drop --use-distributed-optimizer or --ft-rebalance-interval"):
        parse_args([*flags, "--use-distributed-optimizer", "--ft-rebalance-interval", "4"], world_size=4,
                   extra_groups=groups)
    with pytest.raises(ArgumentError, match="use-tp-pp-dp-mapping with pipeline parallelism"):
        parse_args([*flags, "--use-tp-pp-dp-mapping", "--expert-model-parallel-size", "2"], world_size=4,
                   extra_groups=groups)


def test_extra_groups_implement_the_loops_hooks_and_others_are_refused():
    """The loop calls five declared hooks on every extra argument group (megatron/training/extensions.py),
    never probing with ``hasattr``: each group of the entry script implements them, anything else is refused
    with the fix."""
    from dataclasses import dataclass

    import pretrain_gpt_moe
    from megatron.training.extensions import Extension, LoopExtension, check_extension

    for _, cls in pretrain_gpt_moe.extra_argument_groups():
        assert isinstance(cls(), Extension), cls

    @dataclass
    class Bare:
        x: int = 0

    with pytest.raises(TypeError, match="subclass megatron.training.extensions.LoopExtension"):
        check_extension(Bare())
    ext = LoopExtension()
    assert (ext.emulates_fp8, ext.adjust_parallel(None), ext.customize_layer_spec("spec")) == (False, [], "spec")


def test_deterministic_with_transformer_engine_sets_or_refuses_its_switch(data_prefix, monkeypatch):
    """Determinism (the default) with TE: NVTE_ALLOW_NONDETERMINISTIC_ALGO unset becomes 0 (Megatron-Core's TE
    attention refuses to build otherwise); another value is refused at parse time with the fix;
    --no-deterministic takes any value. (TE stands in as an empty module: only its import is checked here.)"""
    import types

    from megatron.training.initialize import deterministic_environment
    from megatron.training.validation import TE_NONDETERMINISTIC_ENV

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    flags = ["--transformer-impl", "transformer_engine", "--data-path", data_prefix]
    monkeypatch.setenv(TE_NONDETERMINISTIC_ENV, "1")
    with pytest.raises(ArgumentError, match="NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, but it is '1': unset it"):
        parse_args(flags, world_size=1)
    assert not parse_args(flags + ["--no-deterministic"], world_size=1).training.deterministic
    monkeypatch.delenv(TE_NONDETERMINISTIC_ENV)
    args = parse_args(flags, world_size=1)
    deterministic_environment(args)
    assert os.environ[TE_NONDETERMINISTIC_ENV] == "0"
    monkeypatch.delenv(TE_NONDETERMINISTIC_ENV)
    deterministic_environment(parse_args(["--data-path", data_prefix], world_size=1))  # local layers: untouched
    assert TE_NONDETERMINISTIC_ENV not in os.environ


QUIET_PROBE = """
import logging, sys
from megatron.training import quiet
quiet.hold()
if "--verbose" in sys.argv:
    quiet.release()
import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs  # warn that TE and Apex are absent
import warnings
warnings.warn("an unexpected warning")
logging.getLogger("megatron.core.transformer.transformer_layer").warning("Unknown MLP type: X. Using default kwargs.")
print("SUMMARY", quiet.summary(), quiet.held_count())
"""


def test_expected_warnings_are_one_line_unless_verbose():
    """Megatron-Core's import-time fallback warnings (real imports) and its 'Unknown MLP type' log are held
    back and summed up; other warnings still print; --verbose prints them all."""
    quiet = subprocess.run([sys.executable, "-c", QUIET_PROBE], capture_output=True, text=True, cwd=ROOT,
                           timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "not installed" not in quiet.stderr and "Unknown MLP type" not in quiet.stderr
    assert "an unexpected warning" in quiet.stderr
    summary = quiet.stdout.split("SUMMARY ", 1)[1]
    assert "Transformer Engine and Apex absent" in summary and "default process groups (1)" in summary
    assert int(summary.split()[-1]) >= 3
    verbose = subprocess.run([sys.executable, "-c", QUIET_PROBE, "--verbose"], capture_output=True, text=True,
                             cwd=ROOT, timeout=120)
    assert "Apex" in verbose.stderr and "not installed" in verbose.stderr and "Unknown MLP type" in verbose.stderr
    assert verbose.stdout.strip().endswith("None 0")


def test_the_snapshot_copy_piece_flag_reaches_the_engine_config(data_prefix):
    """``--ft-snapshot-copy-piece-mb`` (moe_ft/snapshot/pacing.py), ``--ft-snapshot-copy-by`` and
    ``--ft-snapshot-copy-programs`` (moe_ft/snapshot/mapped.py): parsed into the snapshot component's config."""
    import pretrain_gpt_moe

    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-experts", "4", "--moe-router-topk", "2", "--ft",
             "--data-path", data_prefix]
    groups = pretrain_gpt_moe.extra_argument_groups()
    args = parse_args([*flags, "--ft-snapshot-copy-piece-mb", "16"], world_size=1, extra_groups=groups)
    assert args.extra["FTConfig"].snapshot.snapshot_copy_piece_mb == 16
    assert parse_args(flags, world_size=1, extra_groups=groups).extra["FTConfig"].snapshot.snapshot_copy_piece_mb == 0
    snap = parse_args([*flags, "--ft-snapshot-copy-by", "kernel", "--ft-snapshot-copy-programs", "8"], world_size=1,
                      extra_groups=groups).extra["FTConfig"].snapshot
    assert (snap.snapshot_copy_by, snap.snapshot_copy_programs) == ("kernel", 8)
    default = parse_args(flags, world_size=1, extra_groups=groups).extra["FTConfig"].snapshot
    assert (default.snapshot_copy_by, default.snapshot_copy_programs) == ("dma", 16)
    with pytest.raises((ArgumentError, ValueError), match="snapshot-copy-piece-mb"):
        parse_args([*flags, "--ft-snapshot-copy-piece-mb", "-1"], world_size=1, extra_groups=groups)


@pytest.mark.parametrize("policy,impl,refused", [("sparse", "local", True), ("dense", "local", False),
                                                 ("pec", "local", False), ("sparse", "transformer_engine", False)])
def test_a_replaying_policy_refuses_grouped_mlp_experts(policy, impl, refused):
    """GroupedMLP (``--moe-grouped-gemm`` with the local implementation, which needs the CUDA ``grouped_gemm``
    package: checked here on the config alone) keeps a layer's local experts in one weight with one Adam step
    counter: a sparse window's replay cannot keep one expert frozen while another steps, so it is refused with
    one line; policies that do not replay frozen experts, and Transformer Engine's weight per expert, are not."""
    from types import SimpleNamespace

    from moe_ft.config import FTConfig

    args = SimpleNamespace(model=SimpleNamespace(moe_grouped_gemm=True, transformer_impl=impl,
                                                 moe_expert_capacity_factor=None),
                           parallel=SimpleNamespace(use_distributed_optimizer=False, pipeline_model_parallel_size=1))
    config = FTConfig.from_flags(ft=True, ft_policy=policy)
    if refused:
        with pytest.raises(ValueError, match="one expert cannot stay frozen while another steps.*drop --moe-grouped-gemm"):
            config.check_args(args)
    else:
        config.check_args(args)


def test_load_without_a_checkpoint_starts_from_scratch_unless_exit_on_missing_checkpoint(data_prefix, tmp_path):
    """``--load DIR`` without a checkpoint (no directory, or no tracker file in it: a fresh ``--load D --save D``
    job) starts from scratch, as Megatron-LM (the run says so in one line: ``test_checkpoint_flags.py``); before,
    it stopped with exit 2. ``--exit-on-missing-checkpoint`` stops at parsing with one line instead. A tracker
    file that holds no number, or names a missing checkpoint, stops with one line either way (every rank raised
    a ``CheckpointError`` traceback after building the model)."""
    missing = tmp_path / "missing"
    for root in (missing, tmp_path):
        flags = ["--data-path", data_prefix, "--load", str(root)]
        assert parse_args(flags, world_size=1).training.load == str(root)
        with pytest.raises(ArgumentError, match=r"^--load \S+: (no such directory|no latest_checkpointed_iteration"
                                                r".txt, so no complete checkpoint .*), and --exit-on-missing-"
                                                r"checkpoint is given: .*drop the flag to start from scratch$"):
            parse_args([*flags, "--exit-on-missing-checkpoint"], world_size=1)
    flags = ["--data-path", data_prefix, "--load", str(tmp_path)]
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("x")
    with pytest.raises(ArgumentError, match="holds 'x', not an iteration number"):
        parse_args(flags, world_size=1)
    tracker.write_text("4")
    with pytest.raises(ArgumentError, match="names iteration 4 but .*iter_0000004 is missing"):
        parse_args(flags, world_size=1)
    (tmp_path / "iter_0000004").mkdir()
    with pytest.raises(ArgumentError, match=r"cannot read .*iter_0000004"):  # no common.pt
        parse_args(flags, world_size=1)


RESUME_FLAGS = dict(global_batch_size=2, lr="3e-3", min_lr="3e-4", lr_decay_style="cosine", log_interval=1)


@pytest.fixture(scope="module")
def one_rank_checkpoint(corpus, tmp_path_factory):
    """A checkpoint after 4 iterations of a one-rank run (global batch size 2, cosine decay over 4)."""
    ckpt = str(tmp_path_factory.mktemp("resume") / "ckpt")
    torchrun("pretrain_gpt_moe.py", [*tiny_model_flags(**RESUME_FLAGS), "--data-path", corpus, "--train-iters",
                                     "4", "--save", ckpt], nproc=1, timeout=120)
    return ckpt


@pytest.mark.timeout(240)  # two one-rank runs under torchrun
def test_resuming_checks_the_lr_schedule_against_the_flags(corpus, one_rank_checkpoint):
    """``--load`` follows Megatron-LM: the checkpoint's LR/WD schedule must equal the flags' (checked at
    parsing, one line naming the flag and both choices); ``--override-opt-param-scheduler`` trains on with the
    flags' schedule, ``--use-checkpoint-opt-param-scheduler`` with the checkpoint's (the old silent default:
    extending --train-iters kept the old decay length)."""
    import math

    ckpt = one_rank_checkpoint
    flags = [*tiny_model_flags(**RESUME_FLAGS), "--data-path", corpus]
    longer = [*flags, "--train-iters", "8", "--load", ckpt]
    with pytest.raises(ArgumentError, match=r"^--lr-decay-iters \(default --train-iters\) is 8 here but 4 in the LR "
                                            r"schedule of \S+iter_0000004: pass --override-opt-param-scheduler to "
                                            r"train on with the flags' schedule, or --use-checkpoint-opt-param-"
                                            r"scheduler to keep the checkpoint's$"):
        parse_args(longer, world_size=1)
    with pytest.raises(ArgumentError, match="^--lr is 0.01 here but 0.003 in the LR schedule"):
        parse_args([*flags, "--train-iters", "4", "--load", ckpt, "--lr", "1e-2"], world_size=1)
    with pytest.raises(ArgumentError, match="are exclusive"):
        parse_args([*longer, "--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"], world_size=1)
    assert parse_args([*longer, "--use-checkpoint-opt-param-scheduler"], world_size=1).training.load == ckpt
    # a longer --train-iters with the checkpoint's --lr-decay-iters resumes as is
    parse_args([*longer, "--lr-decay-iters", "4"], world_size=1)

    resumed = torchrun("pretrain_gpt_moe.py", [*longer, "--lr", "2e-3", "--override-opt-param-scheduler"], nproc=1,
                       timeout=120)
    lrs = {int(line.split()[1].split("/")[0]): float(line.split("| lr ")[1].split()[0])
           for line in resumed.stdout.splitlines() if line.startswith("iteration ")}
    # the flags' cosine decay from --lr 2e-3 over 8 iterations from the checkpoint's position (the logged LR:
    # the schedule after i iterations); the checkpoint's own decay over 4 would hold it at --min-lr, and its
    # parameter groups' peak (3e-3, loaded with the optimizer state) would be the one decayed
    expected = {i: 3e-4 + 0.5 * (math.cos(math.pi * i / 8) + 1) * (2e-3 - 3e-4) for i in range(5, 9)}
    assert set(lrs) == set(expected) and all(math.isclose(lrs[i], expected[i], rel_tol=2e-3) for i in lrs), lrs


@pytest.mark.timeout(120)
def test_resuming_with_another_global_batch_size_is_refused(corpus, one_rank_checkpoint):
    """The data position of iteration i is i x the global batch size, which the checkpoint records: a --load
    with another size (its default, micro-batch x data-parallel size, follows the world) would replay or skip
    samples, so it stops with one line, whichever LR-schedule choice is passed."""
    keep = ["--data-path", corpus, "--train-iters", "4", "--load", one_rank_checkpoint,
            "--use-checkpoint-opt-param-scheduler"]
    message = (r"^--global-batch-size 4 differs from the 2 that \S+iter_0000004 was trained with \(the resumed run "
               r"would replay or skip data\): pass --global-batch-size 2$")
    with pytest.raises(ArgumentError, match=message):
        parse_args([*tiny_model_flags(**RESUME_FLAGS), *keep, "--global-batch-size", "4"], world_size=1)
    by_default = tiny_model_flags(**{**RESUME_FLAGS, "global_batch_size": None})
    with pytest.raises(ArgumentError, match=message):  # the default on two ranks: micro-batch 2 x 2
        parse_args([*by_default, *keep], world_size=2)
    assert parse_args([*by_default, *keep], world_size=1).training.global_batch_size == 2
