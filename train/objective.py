"""What a draft kind brings to the one training loop.

The loop (``train/loop.py`` and its ``train/module.py``) owns data, the frozen target, optimisation,
checkpoints and logs. A draft kind owns its model and its loss: it subclasses ``Objective``. The loop
gives every step a ``Batch`` of tokens and the ``Teacher`` outputs for it — computed online by a target
forward, or read back from the offline feature cache; the objective never runs the target itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


def decoding_walk_steps(accepted: torch.Tensor, starts: torch.Tensor) -> list[list[int]]:
    """Per row, the accepted lengths of the verify steps greedy chain decoding takes along it, in order.

    ``accepted`` [B, T]: drafted tokens a chain drafted after position t would have accepted;
    ``starts`` [B, T] bool: positions where decoding can start a chain — learnt positions whose next
    token the target produced itself (so not the first token of an answer, which comes from the
    prefill), with k real tokens after them. A step at t that accepts a tokens puts the next draft at
    t + a + 1, right after a rejection, where the draft tends to be weaker: averaging over every start
    instead overstates τ (docs/studies/eagle3_cpu_stages.md, "Held-out τ along the decoding walk", measures by
    how much).
    """
    rows = []
    for lengths, ok in zip(accepted.cpu().tolist(), starts.bool().cpu().tolist()):
        steps, free_from = [], 0
        for t, (a, start) in enumerate(zip(lengths, ok)):
            if start and t >= free_from:
                steps.append(a)
                free_from = t + a + 1
        rows.append(steps)
    return rows


def decoding_walk(accepted: torch.Tensor, starts: torch.Tensor, k: int) -> torch.Tensor:
    """Histogram [k + 1] of the accepted lengths in ``decoding_walk_steps``."""
    counts = [0] * (k + 1)
    for steps in decoding_walk_steps(accepted, starts):
        for a in steps:
            counts[a] += 1
    return torch.tensor(counts, dtype=torch.long)


@dataclass
class Batch:
    """Padded token batch. Shapes: [B, T]."""

    input_ids: torch.Tensor  # int64
    attention_mask: torch.Tensor  # 1 = real token, 0 = padding
    loss_mask: torch.Tensor  # 1 where the token at this position is an assistant token to be learnt
    position_ids: torch.Tensor | None = None
    """Packed rows only: positions restart at 0 where each conversation starts (see train/corpus/tokens.py)."""


@dataclass
class Teacher:
    """The frozen target's view of a Batch.

    ``features``: {layer_id: [B, T, H]} for the layers the objective asked for (0-based "output
    of layer i", see ``decode/features.py``), in the target's dtype.
    ``topk_logits`` / ``topk_ids``: [B, T, K] the target's K largest next-token logits at each
    position and their ids (K = the objective's ``teacher_topk``; K = V means the full logits).
    """

    features: dict[int, torch.Tensor]
    topk_logits: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None


def feature_noise(features: dict[int, torch.Tensor], a: float) -> dict[int, torch.Tensor]:
    """``features`` with uniform noise in [-a, a] added to each (the same dict at a = 0): a draft kind's
    ``feature_noise`` option, for its training steps only, so the draft learns to read slightly wrong features."""
    if not a:
        return features
    return {i: f + (torch.rand_like(f) * 2 - 1) * a for i, f in features.items()}


class Objective(ABC):
    """One draft kind's model and loss."""

    kind: str = "objective"
    capture_layers: tuple[int, ...] = ()
    """Target layers whose outputs the loss needs (resolved, 0-based)."""
    teacher_topk: int = 0
    """How many of the target's next-token logits per position the loss needs (0 = none)."""

    @abstractmethod
    def build_draft(self) -> nn.Module:
        """The trainable draft module (a PreTrainedModel, so save_pretrained works)."""

    @abstractmethod
    def loss(self, draft: nn.Module, batch: Batch, teacher: Teacher) -> dict[str, torch.Tensor]:
        """``{"loss": scalar to minimise, ...other scalars to log}``."""

    @abstractmethod
    @torch.no_grad()
    def chain_lengths(
        self, draft: nn.Module, batch: Batch, teacher: Teacher, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced greedy chains on held-out data: (accepted, starts), both [B, T'] — at each
        position t where decoding can start a chain (``starts``, see ``decoding_walk_steps``), how many
        of the k tokens drafted after t match the target's greedy tokens (0 elsewhere)."""

    @torch.no_grad()
    def acceptance(self, draft: nn.Module, batch: Batch, teacher: Teacher, k: int) -> torch.Tensor:
        """Simulated greedy acceptance on held-out data: counts [k + 1], a histogram of accepted lengths
        (entry j = verify steps where exactly j drafted tokens match the target's greedy tokens), over the
        steps chain decoding would take along each row (``decoding_walk``)."""
        return decoding_walk(*self.chain_lengths(draft, batch, teacher, k), k)

    reads_target_layers: bool = False
    """True when ``build_draft`` copies the target's decoder layers; otherwise a target whose layers were
    never loaded (offline, with a complete feature cache) serves: only its embedding, final norm and LM head."""

    on_policy: bool = False
    """True when ``prepare_batch`` needs the draft to generate (then the target must run online)."""

    def prepare_batch(self, draft: nn.Module, batch: Batch) -> Batch:
        """Change a training batch before the teacher sees it (e.g. on-policy samples); default: as is."""
        return batch

    def save(self, draft: nn.Module, directory: Path) -> None:
        """Write a checkpoint ``draftsmith eval --draft DIR`` can load (default: save_pretrained)."""
        draft.save_pretrained(directory)

    def state_dict(self) -> dict:
        """The objective's own state an exact resume must restore (e.g. a sampling generator)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (default: nothing to restore)."""
        del state  # the default objective keeps no state
