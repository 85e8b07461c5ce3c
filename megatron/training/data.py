"""Training data that replays exactly: the batch of iteration ``t`` is a pure function of
``(seed, t, data-parallel rank)``.

Documents come from a Megatron indexed dataset (``<prefix>.bin/.idx``, ``megatron.core.datasets``). Their
tokens are concatenated (each document followed by the tokenizer's end-of-document token) and cut into
samples of ``seq_length + 1`` tokens; the samples are split into train/valid/test ranges by ``--split``
weights. Each epoch visits the train samples in a permutation drawn from ``numpy.random.default_rng((seed,
epoch))``. Iteration ``t`` consumes global samples ``[t*GBS, (t+1)*GBS)`` in that order; micro-batch ``m``
of data-parallel rank ``r`` takes the ``MBS`` samples starting at ``t*GBS + (m*DP + r)*MBS`` (Megatron's
pretraining sampler layout). Nothing depends on how many iterations ran before, so a recovering job can
rebuild any past batch: :meth:`ReplayableData.batch_for_iteration`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One micro-batch. ``tokens``/``labels``/``loss_mask``: [micro_batch, seq_length];
    ``position_ids``: [micro_batch, seq_length]; ``sample_ids``: [micro_batch] global sample indices."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    sample_ids: torch.Tensor


class TokenSamples:
    """Fixed-length samples cut from the concatenated documents of an indexed dataset."""

    def __init__(self, data_prefix: str, seq_length: int, eod: int) -> None:
        dataset = IndexedDataset(data_prefix, mmap=True)
        pieces = []
        for i in range(len(dataset)):
            pieces.append(np.asarray(dataset[i], dtype=np.int64))
            pieces.append(np.array([eod], dtype=np.int64))
        stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        self.sample_length = seq_length + 1
        self.num_samples = len(stream) // self.sample_length
        if self.num_samples == 0:
            raise ValueError(f"dataset {data_prefix} holds {len(stream)} tokens, fewer than one sample of "
                             f"{self.sample_length}; use more data or a smaller --seq-length")
        self.tokens = torch.from_numpy(stream[: self.num_samples * self.sample_length].copy()).view(
            self.num_samples, self.sample_length)


def split_ranges(num_samples: int, weights: list[int]) -> list[tuple[int, int]]:
    """[start, end) sample ranges for train/valid/test in proportion to ``weights``."""
    total = float(sum(weights))
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(num_samples * w / total)))
    bounds[-1] = num_samples
    return [(bounds[i], min(bounds[i + 1], num_samples)) for i in range(3)]


class ReplayableData:
    """Batches as a pure function of (seed, iteration, data-parallel rank)."""

    def __init__(self, samples: TokenSamples, *, split: list[int], seed: int, micro_batch_size: int,
                 global_batch_size: int, data_parallel_size: int) -> None:
        self.samples = samples
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.data_parallel_size = data_parallel_size
        self.ranges = split_ranges(samples.num_samples, split)
        train_start, train_end = self.ranges[0]
        if train_end - train_start < global_batch_size:
            raise ValueError(f"the train split has {train_end - train_start} samples, fewer than one global "
                             f"batch of {global_batch_size}; use more data or change --split")
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    def _permutation(self, split_idx: int, epoch: int) -> np.ndarray:
        key = (split_idx, epoch)
        if key not in self._perm_cache:
            start, end = self.ranges[split_idx]
            rng = np.random.default_rng([self.seed, split_idx, epoch])
            self._perm_cache = {key: start + rng.permutation(end - start)}  # keep one epoch cached
        return self._perm_cache[key]

    def global_sample_index(self, position: int, split_idx: int = 0) -> int:
        """Dataset sample at position ``position`` of the (endless, per-epoch shuffled) split order."""
        start, end = self.ranges[split_idx]
        size = end - start
        if size <= 0:
            raise ValueError(f"split {split_idx} is empty; give it a positive --split weight")
        epoch, offset = divmod(position, size)
        return int(self._permutation(split_idx, epoch)[offset])

    def sample_ids_for(self, iteration: int, microbatch: int, dp_rank: int, split_idx: int = 0) -> list[int]:
        if not 0 <= dp_rank < self.data_parallel_size:
            raise ValueError(f"dp_rank {dp_rank} out of range [0, {self.data_parallel_size})")
        if not 0 <= microbatch < self.num_microbatches:
            raise ValueError(f"microbatch {microbatch} out of range [0, {self.num_microbatches})")
        base = iteration * self.global_batch_size + (microbatch * self.data_parallel_size + dp_rank) * \
            self.micro_batch_size
        return [self.global_sample_index(base + i, split_idx) for i in range(self.micro_batch_size)]

    def microbatch(self, iteration: int, microbatch: int, dp_rank: int, split_idx: int = 0) -> Batch:
        ids = self.sample_ids_for(iteration, microbatch, dp_rank, split_idx)
        rows = self.samples.tokens[torch.tensor(ids)]
        tokens, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        seq = tokens.shape[1]
        return Batch(tokens=tokens, labels=labels, loss_mask=torch.ones_like(tokens, dtype=torch.float32),
                     position_ids=torch.arange(seq).unsqueeze(0).expand(len(ids), seq).contiguous(),
                     sample_ids=torch.tensor(ids))

    def batch_for_iteration(self, iteration: int, dp_rank: int, split_idx: int = 0) -> list[Batch]:
        """All micro-batches data-parallel rank ``dp_rank`` trains on at ``iteration`` (0-based)."""
        return [self.microbatch(iteration, m, dp_rank, split_idx) for m in range(self.num_microbatches)]
