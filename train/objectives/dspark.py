"""DSpark objective: DFlash's (``train/objectives/dflash.py``: anchors, blocks, slot labels and weights) with
the Markov head of ``drafts/dspark.py`` trained jointly with the backbone.

Slot i of the block anchored at a stands for token a+i and is scored against the target's distribution at
a+i-1, whose context holds the row's token a+i-1; so its Markov bias is taken from that token (teacher
forcing: the anchor for slot 1). Validation's chains (``chain_lengths``) walk as decoding does instead: a
slot past the first is biased by the target's greedy token before it, which is the token decoding drafted
there whenever the chain is still being accepted.
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass

from draftsmith.drafts.base import DSPARK
from draftsmith.drafts.dspark import MAX_MARKOV_RANK, DSparkConfig, DSparkDraft
from draftsmith.train.objective import Batch, Teacher
from draftsmith.train.objectives.common import teacher_greedy
from draftsmith.train.objectives.dflash import DFlashObjective, DFlashOptions
from draftsmith.train.registry import register_objective
from draftsmith.train.schema import SECTION


@dataclass(config=SECTION)
class DSparkOptions(DFlashOptions):
    """``draft.options`` of ``dspark``: DFlash's (D-PACE slot weights by default, on DSpark too: BENCHMARKS,
    "Block drafters"), and the Markov head's rank."""

    markov_rank: Annotated[int, Field(ge=1, le=MAX_MARKOV_RANK)] = 32
    """Rank r of the Markov head (its factors: the target's vocabulary x r and the draft vocabulary x r)."""


class DSparkObjective(DFlashObjective):
    """DFlash's loss over Markov-biased slot logits; see the module docstring."""

    kind = DSPARK

    def __init__(
        self, target, options: DSparkOptions | None = None, token_counts: torch.Tensor | None = None
    ):
        """``options``: ``DSparkOptions`` (DFlash's and the Markov head's rank); see ``DFlashObjective``."""
        options = DSparkOptions() if options is None else options
        super().__init__(target, options, token_counts)
        self.config = DSparkConfig.from_dict({**self.config.to_dict(), "markov_rank": options.markov_rank})

    def build_draft(self) -> DSparkDraft:
        draft = DSparkDraft(DSparkConfig.from_dict(self.config.to_dict()))
        draft.init_from_target(self.target.model, self.token_counts)
        return draft

    def slot_inputs(self, batch: Batch, teacher: Teacher, anchors: torch.Tensor, walk: bool = False
                    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """The token before each drafted slot [B, N, Q - 1]: the anchor, then the row's tokens (training) or
        the target's greedy ones (validation's walk)."""
        B, T = batch.input_ids.shape
        before = (anchors[..., None] + torch.arange(self.config.block_size - 1, device=anchors.device)).clamp(
            max=T - 1
        )  # token a+i-1 for slot i
        source = batch.input_ids
        if walk:  # the target's greedy token at a+i-1 is its prediction from a+i-2
            source = torch.cat([batch.input_ids[:, :1], teacher_greedy(teacher)[:, :-1]], dim=1)
        previous = source.gather(1, before.view(B, -1)).view_as(before)
        previous[..., 0] = batch.input_ids.gather(1, anchors)  # slot 1: the anchor itself
        return {"previous_tokens": previous}


@register_objective(DSPARK, options=DSparkOptions)
def _build(target, options: dict, token_counts=None) -> DSparkObjective:
    return DSparkObjective(target, DSparkOptions(**options), token_counts)
