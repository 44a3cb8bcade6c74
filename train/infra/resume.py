"""Exact resume: what a Lightning checkpoint lacks to continue a run as if it had never stopped.

Lightning saves the weights, optimizer, scheduler and loop counters. ``ExactResume`` adds the rest:

- the data position: it advances the ``ResumableSampler`` for every micro-batch trained on and keeps
  its state (Lightning also stores it through ``ResumableDataLoader``, but not in the checkpoint
  written after ``fit`` returns, when its loaders are gone);
- the RNG states of every rank (torch CPU and CUDA, numpy, python ``random``), gathered into the
  checkpoint and handed back to each rank on resume;
- objective state, for objectives that keep any (``state_dict`` / ``load_state_dict``, e.g. the
  generator of on-policy sampling).

Validation runs on a fork of the RNG streams, so when and how often it runs never changes training.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import lightning as L
import numpy as np
import torch

from draftsmith.train.sampler import ResumableSampler

logger = logging.getLogger(__name__)

KEY = "draftsmith_resume"


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch CPU, the current CUDA device, numpy, python (as tensors and
    plain values, so checkpoints load with ``torch.load(weights_only=True)``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather(obj: Any, trainer: L.Trainer) -> list[Any]:
    """``obj`` from every rank, in rank order (a one-element list without a process group)."""
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return [obj]
    out: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


class ExactResume(L.Callback):
    """Keeps the data position, RNG states and objective state in every checkpoint (see module doc)."""

    def __init__(self, sampler: ResumableSampler, objective: Any = None):
        self.sampler = sampler
        self.objective = objective
        self._val_rng: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.sampler.advance()  # this batch is trained on; a checkpoint after its step skips it

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """Runs on every rank (Lightning builds the checkpoint everywhere, rank 0 writes it)."""
        state: dict[str, Any] = {"rng": rng_state()}
        if self._val_rng is not None:  # saved during validation: keep the training stream, not the fork
            state["rng"] = self._val_rng
        if self.objective is not None and hasattr(self.objective, "state_dict"):
            state["objective"] = self.objective.state_dict()
        per_rank = _gather(state, trainer)
        checkpoint[KEY] = {"world_size": len(per_rank), "data": self.sampler.state_dict(), "ranks": per_rank}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(KEY)
        if saved is None:
            logger.warning(
                "checkpoint holds no RNG states (written by an older version): resume is not exact"
            )
            return
        self.sampler.load_state_dict(saved["data"])
        ranks = saved["ranks"]
        if len(ranks) != trainer.world_size:
            logger.warning(
                "resuming a run of %d ranks on %d: every rank takes rank %d's RNG states",
                len(ranks), trainer.world_size, 0,
            )  # fmt: skip
        state = ranks[trainer.global_rank] if len(ranks) == trainer.world_size else ranks[0]
        set_rng_state(state["rng"])
        if "objective" in state and self.objective is not None and hasattr(self.objective, "load_state_dict"):
            self.objective.load_state_dict(state["objective"])

    # validation (and the sanity check) draws from a fork of the RNG streams
    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_rng = rng_state()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val_rng is not None:
            set_rng_state(self._val_rng)
            self._val_rng = None
