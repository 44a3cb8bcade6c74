"""Resumable, rank-sharded data order for the training loop.

``ResumableSampler`` gives every rank the same number of whole batches per epoch, in an order fixed
by ``(seed, epoch)`` alone, and keeps its position (epoch and rows consumed) as a ``state_dict``
that goes into the checkpoint (``train/infra/resume.py``). The position is advanced by the training loop
for every micro-batch it trains on (``advance``), never by iteration, so a prefetching DataLoader
cannot push it past what was trained; the sampler moves to the next epoch itself when the last
batch of one is taken (it has no ``set_epoch``: Lightning's epoch counter restarts at a new epoch
when a run resumes from the checkpoint written after ``fit`` returned, mid-epoch).

Two orders:

- global (in-memory datasets): one permutation of all rows per epoch; rank r takes every W-th
  row of it. A global batch is then the same set of rows for any world size with the same global
  batch size, so a run on 2 processes matches one on 1 process, and resumes on either.
- by shard (the offline feature cache): rank r reads only the cache shards ``i % W == r`` (the ones
  it wrote under torchrun or srun), shuffled within the rank per epoch; each rank touches 1/W of the files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

logger = logging.getLogger(__name__)


def world() -> tuple[int, int]:
    """(rank, world size) of the initialised process group, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _generator(*keys: int) -> torch.Generator:
    seed = 0
    for key in keys:  # a fixed mix of the keys (Python's hash of ints is not randomised, but be explicit)
        seed = (seed * 1_000_003 + int(key) + 0x9E3779B9) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


class ResumableSampler(Sampler[int]):
    """Shuffled (or ordered), rank-sharded row indices that resume mid-epoch.

    ``batch_size`` is the per-rank micro-batch; each epoch yields a whole number of batches per rank,
    the same on every rank (rows beyond the last whole global batch are left out of that epoch; the
    shuffle changes which). ``shard_sizes`` switches to the by-shard order (see module docstring).
    Rank and world size come from the process group when iteration starts, unless given.
    """

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        shard_sizes: Sequence[int] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        if shard_sizes is not None and sum(shard_sizes) != num_rows:
            raise ValueError(f"shard sizes {list(shard_sizes)} do not add up to {num_rows} rows")
        self.num_rows, self.batch_size, self.seed, self.shuffle = num_rows, batch_size, seed, shuffle
        self.shard_sizes = list(shard_sizes) if shard_sizes is not None else None
        self._rank, self._world = rank, world_size
        self.epoch = 0
        self.consumed = 0  # rows of this epoch trained on, summed over all ranks
        self._saved_world: int | None = None  # world size of the run that wrote a loaded state
        self._lengths: dict[int, int] = {}  # world size -> rows per rank in an epoch

    # ---- where this process stands

    def rank_world(self) -> tuple[int, int]:
        rank, size = world()
        return (rank if self._rank is None else self._rank), (size if self._world is None else self._world)

    def advance(self, batches: int = 1) -> None:
        """Mark ``batches`` micro-batches (on every rank) as trained on; past an epoch's end, start the next."""
        rank, size = self.rank_world()
        epoch_rows = len(self) * size
        self.consumed += batches * self.batch_size * size
        while self.consumed >= epoch_rows:
            self.epoch, self.consumed = self.epoch + 1, self.consumed - epoch_rows

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "world_size": self.rank_world()[1],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"the checkpoint's data order was seeded with {state['seed']}, this run with {self.seed}; "
                "resume with the same trainer.seed"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self._saved_world = int(state.get("world_size", 1))

    # ---- the order

    def _rank_rows(self, rank: int, size: int) -> list[int]:
        """This rank's rows for the whole current epoch, in order (before skipping consumed ones)."""
        if self.shard_sizes is None:
            if self.shuffle:
                order = torch.randperm(self.num_rows, generator=_generator(self.seed, self.epoch)).tolist()
            else:
                order = list(range(self.num_rows))
            usable = self.num_rows // (self.batch_size * size) * self.batch_size * size
            return order[:usable][rank::size]
        per_rank = self._shard_rows(size)
        rows = per_rank[rank]
        if self.shuffle:
            perm = torch.randperm(len(rows), generator=_generator(self.seed, self.epoch, rank)).tolist()
            rows = [rows[i] for i in perm]
        usable = min(len(r) for r in per_rank) // self.batch_size * self.batch_size
        return rows[:usable]

    def _shard_rows(self, size: int) -> list[list[int]]:
        per_rank: list[list[int]] = [[] for _ in range(size)]
        start = 0
        for shard, n in enumerate(self.shard_sizes or []):
            per_rank[shard % size].extend(range(start, start + n))
            start += n
        return per_rank

    def __len__(self) -> int:
        """Rows per rank in a whole epoch (Lightning counts batches from this; it ignores the position)."""
        rank, size = self.rank_world()
        if size in self._lengths:
            return self._lengths[size]
        n = len(self._rank_rows(rank, size))
        if n == 0:
            by = f" in the shards of rank {rank}" if self.shard_sizes is not None else ""
            raise ValueError(
                f"{self.num_rows} training rows{by} do not fill one batch of {self.batch_size} per rank on "
                f"{size} rank(s); add data or lower trainer.batch_size"
            )
        self._lengths[size] = n
        return n

    def __iter__(self) -> Iterator[int]:
        rank, size = self.rank_world()
        rows = self._rank_rows(rank, size)
        skip = self.consumed // size
        if self._saved_world is not None and self._saved_world != size:
            if self.shard_sizes is not None:
                logger.warning(
                    "resuming on %d ranks a run written on %d: the by-shard order of the rest of epoch %d "
                    "differs, some rows of it may be seen twice or not at all",
                    size, self._saved_world, self.epoch,
                )  # fmt: skip
            if self.consumed % size:
                raise ValueError(
                    f"cannot resume a position of {self.consumed} rows on {size} ranks; keep the global "
                    "batch (trainer.batch_size x devices x num_nodes) of the run you resume"
                )
        yield from rows[skip:]


class ResumableDataLoader(DataLoader):
    """A DataLoader over a ``ResumableSampler`` whose position Lightning saves and restores.

    Lightning stores ``state_dict()`` of stateful training loaders in the checkpoint's loop state and
    calls ``load_state_dict`` on resume before iterating; the loader has its own ``generator`` so
    starting an iteration never draws from the global torch RNG (which the run's resume restores).
    """

    def __init__(self, dataset, sampler: ResumableSampler, **kwargs):
        kwargs.setdefault("generator", torch.Generator().manual_seed(sampler.seed))
        super().__init__(dataset, sampler=sampler, batch_size=sampler.batch_size, drop_last=False, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class EvalSampler(Sampler[int]):
    """Held-out rows split across ranks in order, padded by wrapping so every rank gets as many batches."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows

    def _rows(self) -> list[int]:
        rank, size = world()
        per_rank = -(-self.num_rows // size)
        return [(rank + size * i) % self.num_rows for i in range(per_rank)]

    def __len__(self) -> int:
        return len(self._rows())

    def __iter__(self) -> Iterator[int]:
        yield from self._rows()
