"""DSpark drafts (arXiv 2607.05147, DeepSeek's DeepSpec): a DFlash block drafter plus a low-rank Markov head.

The backbone is DFlash's (``drafts/dflash.py``): one parallel forward over a block ``[last token, MASK × (Q-1)]``
reading the target's tapped features gives every slot's base logits. The Markov head then adds, slot by
slot, a bias from the token just before it: slot 1 is biased by the last committed token, slot i > 1 by
the token drafted at slot i - 1, ``logits_i = base_i + W2 · W1[previous]`` with ``W1`` an embedding of the
target's ids [V, r] and ``W2`` a map to the draft vocabulary [Vd, r]. So a block is still one backbone
forward, and the drafts of a block depend on each other (first-order), which plain DFlash's do not.

Tensors and layout are the engines': vLLM 0.32's ``qwen3_dspark.py`` (``markov_head.markov_w1`` /
``markov_w2``) and llama.cpp's ``dflash`` graph (``markov_w1`` / ``markov_w2``, the bias chained by argmax
per block position) read them; draftsmith's block is their fill-in layout (``sample_from_anchor`` false:
slot 0 holds the last token, slots 1..Q-1 are drafted). DSpark's confidence head is not trained: vLLM uses
it only for adaptive verification on CUDA and never stops a block early with it (docs/studies/
dspark_in_vllm_cpu.md), llama.cpp only reports it.

Lossless by the decoder's rule: under sampling slot i is drawn from ``softmax(base_i + bias(previous draw))``
and that distribution is what the verify step is given.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from draftsmith.decode.drafter import Drafter
from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.drafts.base import (
    DRAFT_KIND_KEY,
    DSPARK,
    DraftKind,
    Family,
    loads_strictly,
    register,
)
from draftsmith.drafts.dflash import DFlashConfig, DFlashDraft, DFlashDrafter, load_draft
from draftsmith.drafts.dflash import card_lines as dflash_card_lines

MAX_MARKOV_RANK = 1024
"""The largest Markov rank draftsmith trains (the paper's heads use 32-256; the head is [V, r] + [Vd, r])."""


def check_markov_rank(rank: int) -> int:
    """``draft.options.markov_rank`` as an int in 1..MAX_MARKOV_RANK, or why it cannot be."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_MARKOV_RANK:
        raise ValueError(
            f"draft.options.markov_rank {rank!r} must be an integer in 1..{MAX_MARKOV_RANK}: the rank of the "
            "Markov head's two factors (the target's vocabulary x rank and the draft vocabulary x rank)"
        )
    return rank


class DSparkConfig(DFlashConfig):
    """A DFlash config plus the Markov head's rank."""

    model_type = "draftsmith_dspark"

    def __init__(self, markov_rank: int = 32, **kwargs):
        self.markov_rank = check_markov_rank(markov_rank)
        super().__init__(**kwargs)
        setattr(self, DRAFT_KIND_KEY, DSPARK)

    @classmethod
    def for_target(cls, target, *args, markov_rank: int = 32, **kwargs) -> DSparkConfig:
        """DFlash's config for ``target`` (``DFlashConfig.for_target``'s arguments) with a Markov head of
        rank ``markov_rank``."""
        config = super().for_target(target, *args, **kwargs)
        config.markov_rank = check_markov_rank(markov_rank)
        return config


AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)


class MarkovHead(nn.Module):
    """The bias of a slot's logits from the token before it: ``markov_w2(markov_w1[previous])``."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)  # indexed by the target's ids
        self.markov_w2 = nn.Linear(config.markov_rank, config.draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=config.initializer_range)
        nn.init.zeros_(self.markov_w2.weight)  # a new head starts as plain DFlash

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        """Target ids [...] → biases over the draft vocabulary [..., Vd]."""
        return self.markov_w2(self.markov_w1(previous))


class DSparkDraft(DFlashDraft):
    """DFlash's draft with a Markov head; ``forward`` adds its bias when given the slots' previous tokens."""

    config_class = DSparkConfig
    base_model_prefix = DSPARK

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.markov_head = MarkovHead(config)

    def forward(self, *args, previous_tokens: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """``DFlashDraft.forward``; with the target's ids of the token before each drafted slot
        (``previous_tokens`` [B, N, Q - 1]), slot logits biased by the Markov head (training: inside forward,
        so DDP / FSDP see its parameters)."""
        out = super().forward(*args, **kwargs)
        if previous_tokens is None:
            return out
        return out + self.markov_head(previous_tokens).to(out.dtype)


class DSparkDrafter(DFlashDrafter):
    """DFlash's drafter whose block is chosen slot by slot: each slot's logits biased by the token drafted
    before it (the last committed one for slot 1)."""

    def choose(
        self, logits: torch.Tensor, last_token: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.draft.markov_head
        previous = torch.tensor([last_token], device=logits.device)
        drafted, probs = [], []
        for base in logits:
            biased = base + head(previous)[0].float()
            if sampling.greedy:
                choice = biased.argmax(-1, keepdim=True)
            else:
                probs.append(to_probs(biased, sampling))
                choice = sample(probs[-1], generator)[None]
            previous = self.draft.to_target_ids(choice)
            drafted.append(previous)
        return torch.cat(drafted), torch.stack(probs) if probs else None


def _build(target, path: str) -> Drafter:
    draft = load_draft(target, path, DSparkDraft, "DSpark draft")
    return DSparkDrafter(draft, target.model, name=f"{DSPARK}:{Path(path).name}")


def card_lines(config: dict) -> list[str]:
    return [
        *dflash_card_lines(config),
        f"- a Markov head of rank {config.get('markov_rank')} biases each drafted token's logits by the token "
        "before it (DSpark)",
    ]


DSPARK_BLOCKS = Family(DSPARK, "DSpark draft", verify_hf=loads_strictly(DSparkDraft), card_lines=card_lines)
"""DFlash block drafters with a Markov head (engines key their DSpark writers by this name)."""
register(DraftKind(DSPARK, "DSpark draft", _build, DSPARK_BLOCKS))  # every engine with a DSpark writer
