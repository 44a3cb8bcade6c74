"""Drafting with a causal LM that keeps its own KV cache: independent drafts and layer subsets.

``ModelDrafter`` drives anything that takes ``(input_ids, past_key_values)`` and returns logits
over the target's vocabulary. Its cache holds the committed tokens it has seen plus its own
drafts; ``commit`` crops it back to the accepted length, so nothing is recomputed.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.decode.target import rollback_cache
from draftsmith.drafts.base import Drafter, Proposal


class ModelDrafter(Drafter):
    capture_layers = ()

    def __init__(self, model: torch.nn.Module, name: str, cache_config=None):
        self.model = model
        self.name = name
        self.cache_config = cache_config if cache_config is not None else model.config
        self.cache: DynamicCache | None = None
        self._base = 0  # committed length at the last propose

    def begin(self, prompt: torch.Tensor, features: dict[int, torch.Tensor] | None) -> None:
        self.cache = DynamicCache(config=self.cache_config)
        self.cache.activate_past_recording()

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids.view(1, -1), cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def propose(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> Proposal:
        self._base = tokens.shape[0]
        if k <= 0:
            return Proposal(tokens.new_empty(0))
        logits = self._logits(tokens[self.cache.get_seq_length() :])
        drafted, dists = [], []
        for i in range(k):
            if sampling.greedy:
                tok = logits.argmax(-1)
            else:
                q = to_probs(logits, sampling)
                tok = sample(q, generator)
                dists.append(q)
            drafted.append(tok)
            if i < k - 1:
                logits = self._logits(tok.view(1))
        toks = torch.stack(drafted).to(tokens.device)
        return Proposal(toks, torch.stack(dists) if dists else None)

    def commit(self, num_accepted: int, features: dict[int, torch.Tensor] | None) -> None:
        rollback_cache(self.cache, self._base + num_accepted)
