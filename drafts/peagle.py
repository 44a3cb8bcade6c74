"""P-EAGLE heads (parallel EAGLE-3, arXiv 2602.01469): one forward drafts every token of a chain.

The head is an EAGLE-3 head (``drafts/eagle.py``) with two more things in its config and weights: a mask
token id and ``mask_hidden``, a learnt stand-in for the concatenated target states. To draft k tokens
after the committed ones, one forward of the head runs over the pending real pairs (feature_t,
token_{t+1}), as chain drafting does, and k - 1 slots ``(fuse(mask_hidden), MASK)`` at the positions
that follow, all causal: the last real pair's output proposes the first token, slot d the token d after
it. A slot never sees the tokens drafted before it, so each proposal is a distribution of the committed
context alone, which the shared rejection rule accepts as it is (lossless). ``commit`` drops the slots
from the head's cache with every other draft entry. This is vLLM 0.32's ``parallel_drafting`` for
EAGLE-3 (``v1/spec_decode/llm_base_proposer.py``), which ``export --to vllm`` serves.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.drafts.base import DRAFT_KIND_KEY, PEAGLE, DraftKind, Family, register
from draftsmith.drafts.eagle import EagleHead, card_lines, load_head, verify_saved
from draftsmith.drafts.eagle_drafter import EagleDrafter
from draftsmith.drafts.engines import HF, SGLANG, SPECULATORS, VLLM


def check_parallel(head: EagleHead) -> None:
    """Refuse a head that was not trained to draft in parallel."""
    if not head.config.parallel:
        raise ValueError(
            f"the EAGLE head is a {getattr(head.config, DRAFT_KIND_KEY)} chain head, not a P-EAGLE head: it records "
            "no mask_token_id and has no mask_hidden (train one with draft.kind: peagle)"
        )


class ParallelEagleDrafter(EagleDrafter):
    """Drafts up to ``parallel_depths`` tokens in one forward of a P-EAGLE head; chains only, no trees."""

    propose_tree = Drafter.propose_tree  # a slot sees no sibling: trees are not drafted in parallel

    def __init__(self, head: EagleHead, name: str | None = None):
        check_parallel(head)
        super().__init__(head, name)
        self.max_k = int(head.config.parallel_depths or 1)

    @torch.inference_mode()
    def propose(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> Proposal:
        n = min(k, self.max_k)
        if n <= 0:
            return Proposal(tokens.new_empty(0))
        head, device = self.head, self.head.d2t.device
        slots = n - 1
        mask_ids = torch.full((slots,), head.config.mask_token_id, dtype=torch.long, device=device)
        mask_features = head.mask_feature().expand(slots, -1)
        hidden = self._catch_up(tokens.to(device), mask_features, mask_ids)[-n:]  # last real pair, then slots
        logits = head.draft_logits(hidden).float()  # [n, Vd]
        if sampling.greedy:
            return Proposal(head.d2t[logits.argmax(-1)])
        probs = to_probs(logits, sampling)
        drafted = head.d2t[sample(probs, generator)]
        # the distributions drawn from, over the target's vocabulary, keep the verify rule lossless
        dists = probs.new_zeros(n, head.config.vocab_size).index_copy_(1, head.d2t, probs)
        return Proposal(drafted, dists)


def _build(target, path: str) -> Drafter:
    head = load_head(target, path, "a P-EAGLE head")
    check_parallel(head)
    return ParallelEagleDrafter(head, name=f"{PEAGLE}:{Path(path).name}")


PARALLEL_HEADS = Family(PEAGLE, "P-EAGLE head", verify_hf=verify_saved, card_lines=card_lines)
"""EAGLE heads that draft a whole chain in one forward: stored as ``EagleHead`` (with ``mask_hidden`` and
``mask_token_id``), served in the engines' EAGLE-3 layouts with parallel drafting (``export/peagle.py``)."""
register(DraftKind(PEAGLE, "P-EAGLE head", _build, PARALLEL_HEADS, exports=(HF, VLLM, SPECULATORS, SGLANG), refusal=(
    "llama.cpp 0.3.36's eagle3 graph drafts one token per forward, which would run the head as the chain head it "
    "was not trained to be; export it --to vllm, speculators or sglang")))  # fmt: skip
