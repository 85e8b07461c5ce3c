"""``moe-ft`` startup and dispatch: ``--help`` imports no torch or Megatron (subcommands import their heavy
modules only when they run), every subcommand's ``--help`` works, and the top-level usage errors are one line."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

from moe_ft.cli.main import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "megatron", "matplotlib", "triton")


def _subcommands() -> list[str]:
    action = next(a for a in build_parser()._actions if a.dest == "command")
    return sorted(action.choices)


def test_every_subcommand_is_discovered():
    assert {"digest", "drill", "env", "inspect", "placement", "plan", "simulate"} <= set(_subcommands())


def test_every_subcommand_reports_its_own_usage_errors():
    """Registered through ``errors.reporting``: calling ``args.func`` directly (as tests do) also gives
    exit code 2 and one line, not an exception."""
    action = next(a for a in build_parser()._actions if a.dest == "command")
    unwrapped = [name for name, sub in action.choices.items() if not hasattr(sub.get_default("func"), "__wrapped__")]
    assert unwrapped == []


LAUNCHER = {"launch"}
"""Subcommands whose --help is a launcher's: ``moe-ft launch`` hands its command line to torchrun's parser,
which imports torch (tested in tests/test_inprocess_launch.py)."""


def test_help_and_every_subcommand_help_import_no_torch_or_megatron():
    """In a fresh process (this one has torch already): the top-level and every subcommand's --help."""
    snippet = (
        "import contextlib, io, json, sys\n"
        "from moe_ft.cli.main import main\n"
        f"subs = {[s for s in _subcommands() if s not in LAUNCHER]!r}\n"
        "codes, texts = {}, {}\n"
        "for argv in [['--help']] + [[s, '--help'] for s in subs]:\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        codes[' '.join(argv)] = main(argv)\n"
        "    texts[' '.join(argv)] = out.getvalue()\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print('RESULT ' + json.dumps({'codes': codes, 'texts': texts, 'heavy': heavy}))\n")
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["heavy"] == [], f"--help imported {out['heavy'][:5]}: import them inside the subcommand's run"
    assert set(out["codes"].values()) == {0}
    for sub in sorted(set(_subcommands()) - LAUNCHER):
        assert out["texts"][f"{sub} --help"].startswith(f"usage: moe-ft {sub}"), sub
    assert all(sub in out["texts"]["--help"] for sub in _subcommands())


def test_python_m_moe_ft_help_imports_no_torch():
    """The real entry (``python -m moe_ft``), through ``-X importtime``'s list of every module imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "moe_ft", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "moe_ft.cli.main" in imported
    assert [m for m in imported if m.split(".")[0] in HEAVY] == []


def test_help_starts_in_under_a_second():
    """CPU seconds of ``python -m moe_ft --help`` (best of three): its start-up cost. Wall time on this shared
    machine mostly measures the neighbours' load; importing torch alone costs more than a CPU second."""
    cpu = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-m", "moe_ft", "--help"], capture_output=True, cwd=ROOT, check=True,
                       timeout=60)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    assert min(cpu) < 0.5, cpu


def test_placement_strategy_help_names_every_strategy():
    """``--strategy`` has no argparse choices (they would import the planner, and numpy, for every --help):
    its help text must list the planner's strategies, no more, no less."""
    import re

    from moe_ft.cli.placement import STRATEGY_HELP
    from moe_ft.placement.layers import STRATEGIES

    named = set(re.findall(r"\b[a-z]+\b", STRATEGY_HELP)) & {"optimal", "mro", "spread", "compact", "random", "greedy"}
    assert named == set(STRATEGIES)


def _one_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


def test_no_subcommand_unknown_subcommand_and_bad_flag_are_one_line(capsys):
    assert main([]) == 2
    assert "COMMAND" in _one_line(capsys, "moe-ft")
    assert main(["nope"]) == 2
    assert "invalid choice: 'nope'" in _one_line(capsys, "moe-ft")
    assert main(["placement", "--loads", "1,2", "--nodes", "2", "--slots", "2", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in _one_line(capsys, "moe-ft")  # argparse reports it at the top
    assert main(["placement", "--nodes", "two"]) == 2
    line = _one_line(capsys, "moe-ft placement")
    assert "invalid int value: 'two'" in line and line.endswith("(see moe-ft placement --help)")


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("moe-ft ")


def test_user_error_through_the_console_entry_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "moe_ft", "drill", "--fail", "1:6:persist"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "moe-ft drill: error: persist faults ['1:6:persist:exit'] must sit at an iteration t with (t + 1) a multiple "
        "of --persist-interval (4), e.g. t = 7: the runtime checks them at that save"]
