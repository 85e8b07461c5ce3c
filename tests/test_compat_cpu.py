"""The CPU compatibility layer: each shim does what its docstring says (checked in a fresh process)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)  # the fixture's subprocess: ~15 s on a loaded 2-core machine


@pytest.fixture(scope="module")
def result():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_check_compat_cpu.py")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_activation(result):
    assert result["inactive_before"] and result["active"] and result["idempotent"]


def test_cuda_devices_map_to_cpu(result):
    assert result["current_device"] == "cpu"
    for key in ("zeros_cuda", "tensor_cuda", "empty_int_device", "dot_cuda", "to_cuda", "pin_memory"):
        assert result[key] == "cpu", key
    assert result["to_dtype_still_works"] == "torch.float16"


def test_tensor_type_strings(result):
    assert result["type_fp32"] == "torch.cuda.FloatTensor"
    assert result["type_bf16"] == "torch.cuda.BFloat16Tensor"
    assert result["type_long"] == "torch.LongTensor"  # only the three float types Megatron checks


def test_streams_events_and_rng_tracker(result):
    assert result["elapsed_ms_nonneg"]
    assert result["tracker_class"] == "CpuRNGStatesTracker"
    assert result["default_rng_untouched"] and result["fork_advances_stream"] and result["fork_reproducible"]


def test_moe_utils_shims(result):
    assert result["router_gating_ok"]
    assert result["splits_host"] == "ndarray"


def test_refuses_unsupported_megatron_version(monkeypatch):
    from megatron.core import package_info

    from moe_ft.compat import cpu

    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match="written for megatron-core 0.16.1 but 0.99.0"):
        cpu._check_version()
