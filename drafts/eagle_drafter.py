"""Chain drafting with an EAGLE head (``drafts/eagle.py``) inside the shared speculative decoder.

The drafter's KV cache holds one entry per pair (feature_t, token_{t+1}). Real pairs use the target's
features; draft pairs use the head's own hidden state in place of the feature. Features of committed
positions whose next token is not known yet wait in ``pending`` until the next ``propose``; ``commit``
drops every draft pair and queues the real features the target just computed for the accepted tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.decode.target import rollback_cache
from draftsmith.drafts.base import Drafter, Proposal

if TYPE_CHECKING:
    from draftsmith.drafts.eagle import EagleHead


class EagleDrafter(Drafter):
    """Drafts k tokens chain-wise from an EAGLE head; proposals are over the target's vocabulary."""

    def __init__(self, head: EagleHead, name: str = "eagle"):
        self.head = head
        self.name = name
        self.capture_layers = tuple(head.config.capture_layer_ids)
        self.cache: DynamicCache | None = None
        self.pending: torch.Tensor | None = (
            None  # [m, H] fused features of positions cached_len..cached_len+m-1
        )
        self.cached_len = 0  # real pairs in the cache

    @torch.inference_mode()
    def begin(self, prompt: torch.Tensor, features: dict[int, torch.Tensor] | None) -> None:
        if not features:
            raise ValueError(
                f"the EAGLE drafter needs target features of layers {list(self.capture_layers)}; "
                "set target.set_capture(drafter.capture_layers) before the prefill"
            )
        self.cache = DynamicCache()
        self.cached_len = 0
        self.pending = self.head.fuse(features)

    def _step(self, feature: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Append pairs at positions start.. to the cache; hidden states [S, H]."""
        S = ids.shape[0]
        pos = torch.arange(start, start + S, device=ids.device)
        mask = None  # one query attends to everything cached
        if S > 1:  # query i (position start+i) sees cached keys 0..start+i
            mask = (torch.arange(start + S, device=ids.device)[None, :] <= pos[:, None])[None, None]
        return self.head.step(feature[None], ids[None], pos[None], mask, self.cache)[0]

    @torch.inference_mode()
    def propose(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> Proposal:
        if k <= 0:
            return Proposal(tokens.new_empty(0))
        device = self.head.d2t.device
        tokens = tokens.to(device)
        start, m = self.cached_len, self.pending.shape[0]
        next_ids = tokens[start + 1 : start + 1 + m]
        if next_ids.shape[0] != m or start + m != tokens.shape[0] - 1:
            raise RuntimeError(
                f"EAGLE drafter out of step with the decoder: {start + m} positions with features, "
                f"{tokens.shape[0]} tokens (expected one more token than featured positions)"
            )
        hidden = self._step(self.pending, next_ids, start)[-1:]
        self.cached_len, self.pending = start + m, self.pending[:0]
        drafted, dists = [], []
        for i in range(k):
            logits = self.head.draft_logits(hidden)[-1].float()
            if sampling.greedy:
                draft_id = logits.argmax(-1)
            else:
                q = to_probs(logits, sampling)
                draft_id = sample(q, generator)
                # the distribution actually drawn from, over the target vocabulary, keeps verify lossless
                dists.append(
                    torch.zeros(self.head.config.vocab_size, device=device).index_copy_(0, self.head.d2t, q)
                )
            drafted.append(self.head.d2t[draft_id])
            if i < k - 1:
                hidden = self._step(hidden, draft_id.view(1), self.cached_len + i)
        return Proposal(torch.stack(drafted), torch.stack(dists) if dists else None)

    @torch.inference_mode()
    def commit(self, num_accepted: int, features: dict[int, torch.Tensor] | None) -> None:
        if not features:
            raise ValueError("the EAGLE drafter needs the target's features at every commit")
        rollback_cache(self.cache, self.cached_len)  # drop draft pairs: real features replace them
        self.pending = torch.cat([self.pending, self.head.fuse(features)])
