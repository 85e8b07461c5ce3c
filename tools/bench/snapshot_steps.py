"""The GPU snapshot path cut after one of its steps, to measure what each step costs the training loop
(``tools/bench/gpu_overhead.py --steps copy hash``): snapshots taken and paused in one launch, as with the
whole path, so that the taken/paused ratio of each step's launch is that step's cost plus the ones before it.

* ``copy``: ``submit`` reserves the point's regions and queues the device-to-host copy into them; no device
  hash; the background thread waits for the copy's event and drops the point (its regions go back to the
  arena): no header, metadata entry, manifest, index or garbage collection.
* ``hash``: the copy and the device hash of every tensor (the Triton kernel and the copy of its sums to the
  host); then the point is dropped as above.
* ``publish``: the whole path, unchanged (what ``--steps`` leaves out: the plain sparse launch).

Only the copy into the store's regions (``moe_ft/snapshot/mapped.py``) is cut; an engine without it is refused.
A dropped point is never visible, so the launch cannot recover from it: this is a benchmark, not a mode of the
runtime.
"""

from __future__ import annotations

STEPS = ("copy", "hash", "publish")


def limit_to_step(engine, step: str) -> None:
    """Make ``engine`` (a :class:`moe_ft.snapshot.SnapshotEngine`) stop each snapshot after ``step``."""
    if step not in STEPS:
        raise ValueError(f"unknown snapshot step {step!r}; choose from {', '.join(STEPS)}")
    if step == "publish":
        return
    mapped = getattr(engine, "mapped", None)
    if mapped is None:
        raise ValueError(f"--steps cuts the GPU copy into the store's regions, which this engine does not use: "
                         f"{getattr(engine, 'mapped_off', 'no mapped copier')}")
    if step == "copy":
        if mapped.copy_by == "kernel":
            raise ValueError("--steps copy stops before the device hash, and with --ft-snapshot-copy-by kernel the "
                             "hash kernel is the copy: measure the kernel's copy with the whole path instead")
        mapped._hash = lambda plan, out, *rest: None  # no kernel launch, no copy of sums

    def drop(job, cpu0: float, start: float) -> float:
        """In place of the engine's ``_write``: the copy event was waited for; give the regions back (the record
        says why nothing was published)."""
        job.mapped.point.abort()
        job.record.skipped = f"cut after the {step} step (benchmark)"
        return 0.0

    engine._write = drop
