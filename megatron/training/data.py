"""Training data that replays exactly: the batch of iteration ``t`` is a pure function of
``(seed, t, data-parallel rank)``.

The samples come from Megatron-Core's own datasets: ``GPTDataset`` over memory-mapped indexed datasets
(``<prefix>.bin/.idx``, one or several blended by weight), built by ``BlendedMegatronDatasetBuilder`` with
Megatron-LM's flags (``--data-path``, ``--split``, ``--data-cache-path``, ``--mmap-bin-files``). Sample ``i``
of a split is a pure function of ``(seed, i)``: Megatron-Core shuffles documents and samples per epoch with
the seed, and caches those indices (``--data-cache-path``) instead of concatenating the corpus in memory.

Iteration ``t`` consumes split positions ``[t*GBS, (t+1)*GBS)``; micro-batch ``m`` of data-parallel rank
``r`` takes the ``MBS`` samples starting at ``t*GBS + (m*DP + r)*MBS`` (Megatron's pretraining sampler
layout). Nothing depends on how many iterations ran before, or on which process asks, so a recovering job
rebuilds any past batch (:meth:`ReplayableData.batch_for_iteration`), and a job whose data-parallel size
changed keeps the same global batches.

The datasets are built before the process joins any process group and without collectives (Megatron-Core's
builder synchronizes ranks with barriers once ``torch.distributed`` is initialized, which a replacement
process joining a running job cannot take part in). With ``--data-cache-path``, the first process to take
the directory's lock builds and writes the indices; every other one waits for the lock and reads them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import _IndexReader, get_bin_path, get_idx_path

from megatron.training.arguments import ArgumentError

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One micro-batch. ``tokens``/``labels``/``loss_mask``: [micro_batch, seq_length];
    ``position_ids``: [micro_batch, seq_length]; ``sample_ids``: [micro_batch] positions in the split."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    sample_ids: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the datasets are built from (``DataArgs`` plus the model's sequence length and the seed)."""

    blend: tuple[list[str], list[float] | None]
    split: str
    seq_length: int
    seed: int
    sizes: tuple[int | None, int | None, int | None]
    """Samples each split must provide (``None``: the split is not used)."""
    cache_path: str | None = None
    mmap_bin_files: bool = True


def checked_index(prefix: str) -> _IndexReader:
    """Megatron-Core's reader of ``prefix``'s ``.idx``, refused with one line (an ``ArgumentError``) when the
    ``.idx`` cannot be read or the ``.bin`` does not hold what it describes: ``sum(sequence lengths)`` tokens of
    the index's dtype, from byte 0 (``tools/preprocess_data.py`` writes them contiguously). Megatron-Core
    0.16.1 does not compare the two: a ``.bin`` cut short (a copy that stopped) fails at the first sample
    past its end, in training, with a ``ValueError`` of the memory map's read, and reads uninitialised memory
    as tokens without it (``--no-mmap-bin-files``: an index error in the embedding, a device-side assert on a
    GPU).

    The index reader rather than ``IndexedDataset``: the dataset would map the ``.bin`` too, and one whose
    ``.idx`` fails to read prints an ignored ``AttributeError`` from its ``__del__`` after the line."""
    fix = f"re-create it with `python tools/preprocess_data.py --append-eod --output-prefix {prefix} ...` (or copy " \
          "both files again)"
    try:
        index = _IndexReader(get_idx_path(prefix), multimodal=False)
    except (AssertionError, ValueError, struct.error) as e:  # its header asserts; numpy, struct: a short file
        raise ArgumentError(f"dataset {prefix}: {get_idx_path(prefix)} cannot be read "
                            f"({e or type(e).__name__}); {fix}") from None
    expected = int(index.sequence_lengths.sum(dtype=np.int64)) * index.dtype_size
    actual = os.path.getsize(get_bin_path(prefix))
    if actual != expected:
        raise ArgumentError(f"dataset {prefix}: {get_bin_path(prefix)} holds {actual} bytes but {get_idx_path(prefix)} "
                            f"describes {expected} ({len(index)} sequences, {expected // index.dtype_size} "
                            f"{np.dtype(index.dtype).name} tokens): the .bin is "
                            f"{'truncated' if actual < expected else 'longer than its index'}; {fix}")
    return index


def check_token_ids(prefixes: Sequence[str], vocab_size: int, tokenizer_name: str) -> None:
    """Refuse a dataset holding a token id the model's (padded) vocabulary cannot embed: on a GPU that is a
    device-side assert deep in the embedding, on a CPU an index error. An ``ArgumentError``: the flags do not
    fit the data, and the entry script prints it as one line, as it does a bad flag. Each dataset is opened
    through :func:`checked_index` (its ``.bin`` against its ``.idx``) before it is scanned."""
    for prefix in prefixes:
        index = checked_index(prefix)
        tokens = np.memmap(get_bin_path(prefix), dtype=index.dtype, mode="r")
        top = int(tokens.max()) if tokens.size else -1
        del tokens, index
        if top >= vocab_size:
            raise ArgumentError(f"dataset {prefix} holds token id {top}, beyond the vocabulary of {vocab_size} "
                                f"(--tokenizer-type {tokenizer_name}): pass the tokenizer it was preprocessed "
                                f"with (--tokenizer-type and its files) or --vocab-size {top + 1} or more, or "
                                "preprocess it with this run's tokenizer")


@contextmanager
def _cache_lock(cache_path: str | None) -> Iterator[None]:
    """Exclusive over the index cache directory (node-local: ``flock``), so that one process writes the
    indices and the others read complete files."""
    if cache_path is None:
        yield
        return
    os.makedirs(cache_path, exist_ok=True)
    with open(os.path.join(cache_path, ".moe_ft_build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def _alone() -> Iterator[None]:
    """Outside a process group, ``torch.distributed.get_rank()`` answers 0 while the builder runs:
    Megatron-Core 0.16.1's ``BlendedDataset`` calls it unguarded when it writes its cached indices (a
    blend with ``--data-cache-path`` raised "Default process group has not been initialized"). This process
    builds alone, under the cache lock, which is what rank 0 means there."""
    if dist.is_initialized():
        yield
        return
    real = dist.get_rank
    dist.get_rank = lambda group=None: 0  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.get_rank = real


def build_datasets(config: DataConfig, tokenizer: Any) -> list[Any]:
    """``[train, valid, test]`` datasets (``None`` for a split not used) from Megatron-Core's builder."""
    gpt_config = GPTDatasetConfig(
        random_seed=config.seed, sequence_length=config.seq_length, blend=config.blend, split=config.split,
        path_to_cache=config.cache_path, mmap_bin_files=config.mmap_bin_files, tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    sizes = list(config.sizes)
    if config.blend[1] is not None:  # a weighted blend sizes every split (an unused one: 0)
        sizes = [size or 0 for size in sizes]
    with contextlib.ExitStack() as stack:
        for directory in _cache_dirs(config):  # sorted: processes take them in one order
            stack.enter_context(_cache_lock(directory))
        stack.enter_context(_alone())
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, gpt_config).build()


def _cache_dirs(config: DataConfig) -> list[str]:
    """Where the builder writes its cached indices: ``--data-cache-path``, or without it Megatron-Core's
    default beside each dataset, ``<prefix>/cache/GPTDataset_indices`` (shared by every job that reads the
    same data: unlocked, two processes building at once let one read the other's half-written index)."""
    if config.cache_path is not None:
        return [config.cache_path]
    if dist.is_initialized():  # Megatron-Core's builder orders the ranks itself (a barrier that
        return []  # would deadlock under a lock one rank holds); moe-ft's processes build before any group
    return sorted({os.path.join(prefix, "cache", f"{GPTDataset.__name__}_indices") for prefix in config.blend[0]})


class ReplayableData:
    """Batches as a pure function of (seed, iteration, data-parallel rank) over one dataset per split."""

    def __init__(self, datasets: Sequence[Any], *, micro_batch_size: int, global_batch_size: int,
                 data_parallel_size: int, num_workers: int = 0) -> None:
        self.datasets = list(datasets)
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.data_parallel_size = data_parallel_size
        if self.datasets[0] is None or len(self.datasets[0]) < global_batch_size:
            raise ValueError(f"the train split has {0 if self.datasets[0] is None else len(self.datasets[0])} "
                             f"samples, fewer than one global batch of {global_batch_size}; use more data or "
                             "change --split")
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="data") if num_workers else None
        self._ahead: dict[tuple[int, int, int], Future] = {}

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    def sample_ids_for(self, iteration: int, microbatch: int, dp_rank: int, split_idx: int = 0) -> list[int]:
        if not 0 <= dp_rank < self.data_parallel_size:
            raise ValueError(f"dp_rank {dp_rank} out of range [0, {self.data_parallel_size})")
        if not 0 <= microbatch < self.num_microbatches:
            raise ValueError(f"microbatch {microbatch} out of range [0, {self.num_microbatches})")
        base = iteration * self.global_batch_size + (microbatch * self.data_parallel_size + dp_rank) * \
            self.micro_batch_size
        return list(range(base, base + self.micro_batch_size))

    def _sample(self, split_idx: int, position: int) -> dict:
        dataset = self.datasets[split_idx]
        if dataset is None:
            raise ValueError(f"the {SPLITS[split_idx]} split is empty; give it a positive --split weight")
        if position >= len(dataset):
            raise IndexError(f"{SPLITS[split_idx]} sample {position} asked for, the dataset was built with "
                             f"{len(dataset)} (--train-iters x --global-batch-size for training, --eval-iters x "
                             "--global-batch-size for validation)")
        return dataset[position]

    def microbatch(self, iteration: int, microbatch: int, dp_rank: int, split_idx: int = 0) -> Batch:
        ids = self.sample_ids_for(iteration, microbatch, dp_rank, split_idx)
        samples = [self._sample(split_idx, i) for i in ids]
        return Batch(**{key: torch.stack([s[key] for s in samples])
                        for key in ("tokens", "labels", "loss_mask", "position_ids")},
                     sample_ids=torch.tensor(ids))

    def _build(self, iteration: int, dp_rank: int, split_idx: int) -> list[Batch]:
        return [self.microbatch(iteration, m, dp_rank, split_idx) for m in range(self.num_microbatches)]

    def batch_for_iteration(self, iteration: int, dp_rank: int, split_idx: int = 0) -> list[Batch]:
        """All micro-batches data-parallel rank ``dp_rank`` trains on at ``iteration`` (0-based). With
        ``--num-workers``, the next iteration's are built in the background meanwhile (a pure function:
        whatever order iterations are asked in, a replay included, the batches are the same)."""
        if self._pool is None:
            return self._build(iteration, dp_rank, split_idx)
        key = (iteration, dp_rank, split_idx)
        ahead = self._ahead.pop(key, None)
        self._ahead = {}  # a replay or a jump: what was built ahead is not asked for
        nxt = (iteration + 1, dp_rank, split_idx)
        self._ahead[nxt] = self._pool.submit(self._build, *nxt)
        return ahead.result() if ahead is not None else self._build(iteration, dp_rank, split_idx)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
