"""torchrun worker of ``tests/test_comm_rule.py``: ``pretrain_gpt_moe.main`` under the collective checker.

The checker is installed before anything creates a process group (so it sees which groups are gloo) and
streams the calls of our code to ``$MOE_FT_COMM_CHECK_DIR/rank<R>.attempt<A>.jsonl`` as they happen (a rank
SIGKILLed by a fault keeps what it did); the library-call counts go to ``….summary.json`` at exit. The
production entry point is unchanged: no flag, no hook in ``moe_ft`` or ``megatron/training``.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> int:
    from moe_ft.testing.collective_checker import CollectiveChecker

    out = os.environ["MOE_FT_COMM_CHECK_DIR"]
    name = f"rank{os.environ.get('RANK', '0')}.attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    checker = CollectiveChecker(log_path=os.path.join(out, name + ".jsonl")).install()
    try:
        import pretrain_gpt_moe

        return pretrain_gpt_moe.main(sys.argv[1:])
    finally:
        with open(os.path.join(out, name + ".summary.json"), "w") as f:
            json.dump(checker.summary(), f, indent=1)
        checker.uninstall()


if __name__ == "__main__":  # required: Megatron's checkpoint writer re-imports the main module
    sys.exit(main())
