"""``python -m moe_ft.launch``: the same as ``moe-ft launch`` (``moe_ft/launch/cli.py``)."""

import sys

from moe_ft.launch.cli import main

if __name__ == "__main__":  # required: Megatron's checkpoint writer re-imports the main module
    sys.exit(main())
