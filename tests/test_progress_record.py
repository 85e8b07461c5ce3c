"""The node-local progress record: one fixed-width line rewritten in place every iteration (one ``pwrite``
on the training thread), read back by recovery and the drills in either format."""

from __future__ import annotations

import os

import pytest

from moe_ft.drills.report import last_completed as drill_last_completed
from moe_ft.recovery.progress import RECORD, ProgressFile, last_completed, read_progress, write_progress


def test_a_record_is_rewritten_in_place_and_read_back(tmp_path):
    path = tmp_path / "job" / "progress_rank0"
    record = ProgressFile(path)
    assert read_progress(path) is None
    record.write(7)
    inode = os.stat(path).st_ino
    for it in (8, 9, 123456789):
        record.write(it)
        assert read_progress(path) == it
        assert os.stat(path).st_ino == inode and os.stat(path).st_size == len(RECORD % 0)
    record.close()
    record.close()  # twice: nothing left to close
    ProgressFile(path).write(3)  # a restarted process reopens the same file: the newest record wins
    assert read_progress(path) == 3


@pytest.mark.parametrize("old", ["5", "1" * 30])
def test_a_record_of_the_renamed_format_is_read_and_then_replaced(tmp_path, old):
    """A record written by ``write_progress`` (an older process, or the durable tier's) reads back; the
    first in-place write over it leaves exactly one fixed-width line, whether the old one was shorter or
    longer."""
    path = tmp_path / "progress_rank1"
    write_progress(path, int(old))
    assert read_progress(path) == int(old)
    record = ProgressFile(path)
    record.write(6)
    assert path.read_bytes() == RECORD % 6 and read_progress(path) == 6
    record.close()


def test_missing_empty_and_unreadable_records(tmp_path):
    path = tmp_path / "progress_rank0"
    assert read_progress(path) is None
    path.write_text("")
    assert read_progress(path) is None  # created, not written yet
    path.write_text("twelve")
    with pytest.raises(ValueError, match="progress_rank0 holds 'twelve'.*remove the file"):
        read_progress(path)


def test_recovery_and_the_drills_read_both_formats(tmp_path):
    """``last_completed`` of a rank (its node-local record and the durable tier's, one process: no
    collective) and of the drill driver (every record of the node stores, while the ranks run)."""
    store, durable = tmp_path / "store", tmp_path / "durable"
    ProgressFile(store / "job" / "progress_rank0").write(11)
    write_progress(durable / "progress", 12)
    assert last_completed(str(store), "job", 0) == 11
    assert last_completed(str(store), "job", 0, durable_dir=durable) == 12
    assert last_completed(str(store), "job", 1) == -1
    (store / "job" / "progress_rank1").write_text("9")  # an older process's renamed record
    ProgressFile(tmp_path / "other" / "job" / "progress_rank2").write(10)
    assert drill_last_completed([store, tmp_path / "other"]) == 11
