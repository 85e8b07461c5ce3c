import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import pytest_timeout
import torch
from filelock import FileLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the module defining it is first
# imported — which collection may do from any test module. Without CUDA the interpreter is the only way
# Triton kernels run, so set it before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The drills of this suite run under moe-ft launch (moe_ft/launch/: one warm spare, survivors recover in
# their processes; several simulated nodes: every worker restarts) with workers forked from a launcher that
# imported the training stack once, ~4.5 s less CPU per worker. Tests that must show plain torchrun pass
# launcher="torchrun".
os.environ.setdefault("MOE_FT_DRILL_LAUNCHER", "inprocess-preloaded")

# after the settings above: ROOT on sys.path, TRITON_INTERPRET before any kernel module
from moe_ft.cli.drill import run_job  # noqa: E402
from tests._ft_helpers import make_corpus, one_rank_megatron  # noqa: E402
from tools.make_corpus import write_corpus  # noqa: E402

LONGEST_FIRST = (
    "test_tensor_parallel", "test_localized_recovery", "test_inprocess_launch", "test_recovery_drill",
    "test_node_drill", "test_checkfree_plus_drill", "test_checkfree_drill", "test_foundation_multiproc",
    "test_optim_recompute", "test_live_rebalance", "test_elastic_ckpt", "test_precision_recovery",
    "test_elastic_drill", "test_elastic_train", "test_elastic_reshape_ckpt", "test_elastic_ft",
    "test_localized_vpp", "test_replication_recovery", "test_checkfree_plus_run", "test_upstream_log",
    "test_recipes", "test_comm_rule", "test_runtime", "test_compat_writer_queue", "test_persist_fault",
    "test_tokenizers", "test_elastic_corrupt", "test_group_step_drill", "test_replication_runtime",
    "test_bubble_snapshots_run", "test_checkfree_swap_pp", "test_store_capacity", "test_recovery_schedule",
    "test_elastic_fallback", "test_replication_transport", "test_loop_independent", "test_checkfree_comm",
)
"""The modules that take longest (10-95 s each on one worker of the CI machine, mostly multi-process
drills), longest first. ``make test`` runs the suite on several workers (pytest-xdist, one module per
worker at a time): starting these first lets the short modules fill the end instead of one long module
running alone."""


def pytest_collection_modifyitems(config, items):
    """The longest modules first (:data:`LONGEST_FIRST`; the order inside a module is kept). GPU tests carry
    the ``gpu`` marker and are skipped with the reason "no CUDA" on CPU machines."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_exception_interact(node, call, report):
    """pytest-timeout stops a test's timer when the test fails (so that a debugger may take over), and a
    teardown that then waits (a fixture's goodbye to a node agent the failed test left stopped) held a CI run
    for 24 minutes. Without ``--pdb`` the timer is set again, from now, for what the test has left to run."""
    if node.config.getoption("usepdb") or not isinstance(node, pytest.Item):
        return
    settings = pytest_timeout._get_item_settings(node)  # the plugin's settings for the item (not public API)
    if settings.timeout and not settings.func_only:
        node.config.hook.pytest_timeout_set_timer(item=node, settings=settings)


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_basetemp(tmp_path_factory):
    """Temporary files of this session's processes, and of the processes they start, under pytest's base
    directory (which pytest prunes to the last three runs) instead of ``/tmp``: ``torchrun`` and ``moe-ft
    launch`` keep a log directory per job there when no ``--log-dir`` is given (``torchelastic_*``,
    ``moe_ft_launch_*``), and every run of the suite left a few thousand."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Prefix of a small Megatron indexed dataset made from the generated corpus, written once per session
    (the one definition: every test that trains reads it)."""
    return make_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture
def data_prefix(tmp_path):
    """Prefix of an empty indexed dataset (``d.bin``/``d.idx``): enough for flag parsing, which checks that
    the files exist; nothing reads them."""
    for suffix in (".bin", ".idx"):
        (tmp_path / f"d{suffix}").write_bytes(b"")
    return str(tmp_path / "d")


@pytest.fixture(scope="session")
def bpe(tmp_path_factory):
    """``(corpus.jsonl, vocab.json, merges.txt, tokenizer.json)`` of a GPT-2 style byte-level BPE (512 ids)
    trained here from the generated corpus (nothing is downloaded)."""
    tokenizers = pytest.importorskip("tokenizers")
    d = tmp_path_factory.mktemp("bpe")
    corpus = str(d / "c.jsonl")
    write_corpus(corpus, num_docs=300, seed=5)
    texts = [json.loads(line)["text"] for line in open(corpus)]
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(texts, vocab_size=512, min_frequency=2, special_tokens=["<|endoftext|>"])
    vocab, merges = trainer.save_model(str(d))
    trainer.save(str(d / "tokenizer.json"))
    return corpus, vocab, merges, str(d / "tokenizer.json")


@pytest.fixture
def megatron_world():
    """A one-rank Megatron world for the test (gloo on a ``HashStore``, ``parallel_state`` initialised, one
    thread, deterministic algorithms), torn down after it; see ``tests/_ft_helpers.py``."""
    with one_rank_megatron():
        yield


def _shared_dir(tmp_path_factory) -> Path:
    """A directory every worker of this session sees: the base temporary directory, or under ``pytest -n``
    (pytest-xdist) its parent, which holds the workers' base directories."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def fault_free_digest(corpus, tmp_path_factory):
    """``fault_free_digest(layout, iters=8, extra=())`` -> the training-state digest of the fault-free tiny
    drill job (``moe_ft/cli/drill.py``: its flags, ``layout``, ``iters`` iterations, sparse snapshots with a
    window of 3, global recovery scope), launched once per session for each distinct request.

    Every failure drill compares its final digest with this bitwise. The fault-tolerance settings of the
    faulty run (policy, window, recovery scope, replicas, node layout) may differ from the reference's:
    taking snapshots, logging and replicating never change the training state, so the plain fault-free run
    is the reference for all of them. ``extra`` holds only flags that change training."""
    work = tmp_path_factory.mktemp("fault_free")
    shared = _shared_dir(tmp_path_factory) / "fault_free_digests"
    shared.mkdir(exist_ok=True)

    def get(layout: str, iters: int = 8, extra: tuple[str, ...] = ()) -> str:
        name = hashlib.sha1(json.dumps([layout, iters, list(extra)]).encode()).hexdigest()[:16]
        known = shared / f"{name}.digest"
        with FileLock(str(shared / f"{name}.lock")):  # the workers of ``pytest -n`` launch each reference once
            if not known.exists():
                job = f"ref_{name}_{layout}_{iters}"
                res = run_job(job=job, workdir=str(work), timeout=300, layout=layout, policy="sparse", iters=iters,
                              data=corpus, store=str(work / f"store_{name}"), window=3, extra=list(extra))
                assert res["rc"] == 0 and res["digest"], f"fault-free {layout} run failed, see {res['log']}"
                assert res["reports"] == []
                known.write_text(res["digest"])
            return known.read_text()

    return get
