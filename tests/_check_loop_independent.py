"""Run in a fresh process by tests/test_loop_independent.py (the CPU layer changes process-wide state).

    python tests/_check_loop_independent.py imports          # import every megatron.training module
    python tests/_check_loop_independent.py unguarded        # the loop's CUDA-or-CPU-layer guard
    python tests/_check_loop_independent.py train DATA DIR   # save, then load, with moe_ft imports blocked

Prints one ``RESULT <json>`` line.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests._ft_helpers import tiny_model_flags  # noqa: E402  (needs the repository on sys.path)

TINY = tiny_model_flags(ffn_hidden_size=64, max_position_embeddings=32, global_batch_size=4, lr="3e-3",
                        seed=1234, split=(98, 2, 0), tokenizer_type="ByteLevel", log_interval=100,
                        eval_interval=0)


def moe_ft_modules() -> list[str]:
    return sorted(name for name in sys.modules if name == "moe_ft" or name.startswith("moe_ft."))


class BlockMoeFt:
    """A meta-path finder that refuses every ``moe_ft`` import not already done."""

    def __init__(self) -> None:
        self.attempts: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name == "moe_ft" or name.startswith("moe_ft."):
            self.attempts.append(name)
            raise ImportError(f"the training loop imported {name}")
        return None


def check_imports() -> dict:
    import megatron.training as pkg

    names = [f"megatron.training.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    for name in names:
        importlib.import_module(name)
    return {"modules": names, "moe_ft": moe_ft_modules()}


def check_unguarded() -> dict:
    """The loop's guard before and after the CPU layer is activated."""
    from megatron.training.initialize import require_cuda_or_cpu_layer

    out = {}
    for when in ("before", "after"):
        if when == "after":
            from moe_ft.compat import activate_all

            activate_all()
        try:
            require_cuda_or_cpu_layer()
            out[when] = None
        except RuntimeError as e:
            out[when] = str(e)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_train(data: str, workdir: str) -> dict:
    """One rank, gloo: train 2 iterations and save, then a second run loads that checkpoint and trains
    one more; ``moe_ft`` can be imported only before the loop starts (the compat shims)."""
    from moe_ft.compat import activate_all

    activate_all()
    before = moe_ft_modules()
    blocker = BlockMoeFt()
    sys.meta_path.insert(0, blocker)
    from megatron.training.arguments import parse_args
    from megatron.training.pretrain import pretrain

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    save = os.path.join(workdir, "ckpt")
    reports = []
    for argv in (["--train-iters", "2", "--save", save, "--save-interval", "2"],
                 ["--train-iters", "3", "--load", save, "--use-checkpoint-opt-param-scheduler"]):
        os.environ["MASTER_PORT"] = str(_free_port())
        report = pretrain(parse_args([*TINY, "--data-path", data, *argv]))
        reports.append(report.last_iteration)
    return {"before": before, "after": moe_ft_modules(), "attempts": blocker.attempts, "last_iterations": reports}


def main() -> None:
    mode = sys.argv[1]
    if mode == "imports":
        out = check_imports()
    elif mode == "unguarded":
        out = check_unguarded()
    else:
        out = check_train(sys.argv[2], sys.argv[3])
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":  # required: Megatron's checkpoint writer may re-import the main module
    main()
