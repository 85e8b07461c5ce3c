"""``moe-ft env``: versions, device, distributed backend and whether the CPU layer is needed/active."""

from __future__ import annotations

import json
import platform

from moe_ft.cli.errors import reporting, user_input


def collect() -> dict:
    # start-up time: `moe-ft` imports every subcommand module for --help; torch only when this command runs
    import torch

    info: dict = {
        "moe_ft": __import__("moe_ft").__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "backend": "nccl" if torch.cuda.is_available() else "gloo",
    }
    try:
        # start-up time: `moe-ft` imports every subcommand module for --help; torch only when this command runs
        from megatron.core import package_info

        info["megatron_core"] = package_info.__version__
    except ImportError:
        info["megatron_core"] = None
    # start-up time: the CPU layer imports Megatron-Core (seconds); only when this command runs
    from moe_ft.compat import cpu

    info["cpu_layer_supported_versions"] = list(cpu.SUPPORTED_MCORE_VERSIONS)
    info["cpu_layer_needed"] = not torch.cuda.is_available()
    info["cpu_layer_active"] = cpu.state().active
    for name, module in (("transformer_engine", "transformer_engine"), ("triton", "triton"),
                         ("apex", "apex"), ("nvidia_dali", "nvidia.dali")):
        try:
            mod = __import__(module, fromlist=["__version__"])
            info[name] = getattr(mod, "__version__", "installed")
        except ImportError:
            info[name] = None
        except Exception as e:  # a GPU extra that is installed but cannot load here
            info[name] = f"unusable: {type(e).__name__}"
    return info


def run(args) -> int:
    info = collect()
    if args.activate:
        # start-up time: the CPU layer imports Megatron-Core (seconds); only when this command runs
        from moe_ft.compat import cpu

        with user_input(RuntimeError):  # a megatron-core version the layer was not written for
            cpu.activate()
        info["cpu_layer_active"] = cpu.state().active
        info["cpu_layer_shims"] = cpu.state().shims
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("env", help="print versions, device, backend and the CPU-layer status")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--activate", action="store_true",
                   help="also activate the CPU layer in this process and list its shims")
    p.set_defaults(func=reporting("env", run))
