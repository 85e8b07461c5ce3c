"""Run in a fresh process by tests/test_compat_cpu.py: activating the CPU layer changes process-wide
state (torch.cuda entry points, a torch-function mode), which must not leak into the pytest process."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests._ft_helpers import one_rank_gloo  # noqa: E402  (needs the repository on sys.path)


def main() -> None:
    import torch

    from moe_ft.compat import cpu

    out = {}
    out["inactive_before"] = not cpu.state().active
    state = cpu.activate()
    out["active"] = state.active
    out["idempotent"] = cpu.activate() is state
    out["current_device"] = str(torch.cuda.current_device())
    out["zeros_cuda"] = torch.zeros(2, device="cuda").device.type
    out["tensor_cuda"] = torch.tensor([1.0], device="cuda:0").device.type
    out["empty_int_device"] = torch.empty(3, device=0).device.type
    out["dot_cuda"] = torch.ones(2).cuda().device.type
    out["to_cuda"] = torch.ones(2).to("cuda").device.type
    out["to_dtype_still_works"] = str(torch.ones(2).to(torch.float16).dtype)
    out["pin_memory"] = torch.ones(2).pin_memory().device.type
    out["type_fp32"] = torch.ones(2).type()
    out["type_bf16"] = torch.ones(2, dtype=torch.bfloat16).type()
    out["type_long"] = torch.ones(2, dtype=torch.long).type()
    stream = torch.cuda.Stream()
    event = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        event.record()
    torch.cuda.current_stream().wait_stream(stream)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    torch.cuda.synchronize()
    out["elapsed_ms_nonneg"] = event.elapsed_time(end) >= 0

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    with one_rank_gloo():  # destroyed on leaving
        ps.initialize_model_parallel()
        model_parallel_cuda_manual_seed(123)
        tracker = get_cuda_rng_tracker()
        out["tracker_class"] = type(tracker).__name__
        torch.manual_seed(7)
        before = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(3)
        out["default_rng_untouched"] = bool(torch.equal(before, torch.get_rng_state()))
        with tracker.fork():
            b = torch.rand(3)
        out["fork_advances_stream"] = not torch.equal(a, b)
        model_parallel_cuda_manual_seed(123)
        with get_cuda_rng_tracker().fork():
            a2 = torch.rand(3)
        out["fork_reproducible"] = bool(torch.equal(a, a2))

        # shim 4 and 5: the router's gating function and the alltoall split sizes on CPU tensors
        from megatron.core.transformer.moe import moe_utils

        w = torch.randn(4, 8, requires_grad=True)
        x = torch.randn(5, 8, requires_grad=True)
        logits = moe_utils.router_gating_linear(x, w, None, torch.float32)
        logits.sum().backward()
        out["router_gating_ok"] = list(logits.shape) == [5, 4] and w.grad is not None
        splits = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
        out["splits_host"] = type(splits).__name__
        ps.destroy_model_parallel()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
