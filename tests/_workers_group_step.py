"""``pretrain_gpt_moe.py`` as on an install with Transformer Engine: Megatron-Core builds its ``FusedAdam``
class (here the substitute of ``tests/_group_step_adam.py``, whose step is counted in the parameter group
as FusedAdam counts it) instead of torch's AdamW. Each rank that builds one touches
``$GROUP_STEP_MARKER_DIR/rank<RANK>``, so that the test knows the substitute was trained."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import megatron.core.optimizer as mcore_optimizer

from tests._group_step_adam import GroupStepAdamW


class MarkedGroupStepAdamW(GroupStepAdamW):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        (Path(os.environ["GROUP_STEP_MARKER_DIR"]) / f"rank{os.environ['RANK']}").touch()


if __name__ == "__main__":  # required: Megatron's checkpoint writer re-imports the main module
    # what megatron/core/optimizer/__init__.py sets when transformer_engine's FusedAdam imports
    mcore_optimizer.Adam = MarkedGroupStepAdamW
    mcore_optimizer.USING_PYTORCH_OPTIMIZER = False
    import pretrain_gpt_moe

    sys.exit(pretrain_gpt_moe.main())
