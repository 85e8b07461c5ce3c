"""Where GPU tests record the numbers they measure: ``$MOE_FT_GPU_RESULTS/<name>.json`` when that variable
names a directory (the device run collects them for docs/benchmarks.md); always printed too."""

from __future__ import annotations

import json
import os


def record(name: str, numbers: dict) -> None:
    print(f"[gpu result] {name}: {json.dumps(numbers)}")
    directory = os.environ.get("MOE_FT_GPU_RESULTS")
    if directory:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{name}.json"), "w") as f:
            json.dump(numbers, f, indent=1)
