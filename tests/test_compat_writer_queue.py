"""``moe_ft.compat.writer_queue``: megatron-core's checkpoint writer leaves no server process behind.

Without it, the first ``dist_checkpointing.save`` of a process starts a multiprocessing Manager (a spawned
server) that a SIGKILLed rank leaves running forever, holding the job's stdout. One process saves a tiny
sharded tensor and reports its live child processes after the save; then it SIGKILLs itself and the test
checks what it left alive.
"""

import os
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = r"""
import os, signal, sys, tempfile
import psutil, torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + tempfile.mktemp())
from moe_ft.compat import cpu
cpu.activate()
if sys.argv[1] == "install":
    from moe_ft.compat import writer_queue
    writer_queue.install()
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
out = tempfile.mkdtemp()
dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}, out)
with open(sys.argv[2], "w") as f:
    f.write(" ".join(str(p.pid) for p in psutil.Process().children(recursive=True)))
os.kill(os.getpid(), signal.SIGKILL)
"""


def run(mode, tmp_path):
    """The child's children right after its save. Output goes to a file: a leaked server holding a pipe
    would keep ``subprocess.run`` waiting for EOF forever (the very symptom)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result, log = tmp_path / f"{mode}.pids", tmp_path / f"{mode}.log"
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-c", SCRIPT, mode, str(result)], env=env, stdout=out, stderr=out,
                       timeout=100, start_new_session=True)
    assert result.exists(), log.read_text()[-3000:]
    return [int(p) for p in result.read_text().split()]


def alive(pids):
    time.sleep(0.5)
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_killed_rank_leaves_no_writer_process(tmp_path):
    assert run("install", tmp_path) == []  # the results travel through a pipe: no server to leak


def test_without_it_megatron_leaves_a_server_running(tmp_path):
    leaked = run("plain", tmp_path)  # documents the megatron-core 0.16.1 behaviour the shim exists for
    try:
        assert alive(leaked), "megatron-core no longer starts a Manager: the shim may be unnecessary"
    finally:
        for pid in alive(leaked):
            psutil.Process(pid).kill()


SAVES = r"""
import sys, tempfile, torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + tempfile.mktemp())
from moe_ft.compat import cpu, writer_queue
cpu.activate()
writer_queue.install()
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
for i in range(int(sys.argv[1])):
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0) + i)}, tempfile.mkdtemp())
print("saved", sys.argv[1])
"""


def test_results_arrive_under_load(tmp_path):
    """megatron-core reads the results with ``get_nowait`` right after the put; a plain pipe queue lost that
    race under CPU contention ("results_queue should not be empty": 4 processes x 40 saves on 2 cores failed
    before :class:`ResultsQueue`)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    logs = [tmp_path / f"saves{i}.log" for i in range(4)]
    procs = [subprocess.Popen([sys.executable, "-c", SAVES, "40"], env=env, stdout=open(log, "w"),
                              stderr=subprocess.STDOUT, start_new_session=True) for log in logs]
    for proc, log in zip(procs, logs):
        assert proc.wait(timeout=100) == 0, log.read_text()[-3000:]
        assert "saved 40" in log.read_text()

