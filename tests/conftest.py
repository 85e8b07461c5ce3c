import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests._ft_helpers import make_corpus, one_rank_megatron  # noqa: E402  (needs ROOT on sys.path)

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the module defining it is first
# imported — which collection may do from any test module. Without CUDA the interpreter is the only way
# Triton kernels run, so set it before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """GPU tests carry the ``gpu`` marker and are skipped with the reason "no CUDA" on CPU machines."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Prefix of a small Megatron indexed dataset made from the generated corpus, written once per session
    (the one definition: every test that trains reads it)."""
    return make_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture
def megatron_world():
    """A one-rank Megatron world for the test (gloo on a ``HashStore``, ``parallel_state`` initialised, one
    thread, deterministic algorithms), torn down after it; see ``tests/_ft_helpers.py``."""
    with one_rank_megatron():
        yield
