"""Drafting with a causal LM that keeps its own KV cache: independent drafts and layer subsets.

``ModelDrafter`` drives anything that takes ``(input_ids, past_key_values)`` and returns logits
over the target's vocabulary. Its cache holds the committed tokens it has seen plus its own
drafts; ``commit`` crops it back to the accepted length, so nothing is recomputed.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache

from draftsmith.decode.batched import BatchedLM, pad_rows
from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.decode.target import COMPILE_MAX_WIDTH, rollback_cache


class ModelDrafter(Drafter):
    capture_layers = ()

    def __init__(self, model: torch.nn.Module, name: str, cache_config=None):
        self.model = model
        self.name = name
        self.cache_config = cache_config if cache_config is not None else model.config
        self.cache: DynamicCache | StaticCache | None = None
        self.static_cache_len: int | None = None
        self._compiled = None
        self._base = 0  # committed length at the last propose

    def begin(self, prompt: torch.Tensor, features: dict[int, torch.Tensor] | None) -> None:
        if self.static_cache_len is not None:
            if isinstance(self.cache, StaticCache):
                with torch.inference_mode():
                    self.cache.reset()  # same buffers: compiled graphs keep their addresses
            else:
                self.cache = StaticCache(config=self.cache_config, max_cache_len=self.static_cache_len)
        else:
            self.cache = DynamicCache(config=self.cache_config)
            self.cache.activate_past_recording()

    def use_static_cache(self, max_len: int | None) -> None:
        """Preallocate the draft's KV cache (as ``Target.use_static_cache``); None = a growing cache."""
        if max_len is not None:
            probe = StaticCache(config=self.cache_config, max_cache_len=max(max_len, 2))
            if not probe.is_croppable:
                raise ValueError(
                    f"draft {self.name!r}: its static cache cannot be rolled back (sliding-window layers)"
                )
        self.static_cache_len, self.cache, self._compiled = max_len, None, None

    def compile(self, mode: str | None = None) -> None:
        """``torch.compile`` the draft's steps of at most ``COMPILE_MAX_WIDTH`` tokens (one graph per
        width: 1 for each drafted token, up to k + 1 for the catch-up after a verify pass)."""
        if self.static_cache_len is None:
            raise ValueError("compile() needs a static KV cache: call use_static_cache(max_len) first")
        self._compiled = torch.compile(self.model, dynamic=False, mode=mode)

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        model = (
            self._compiled if self._compiled is not None and ids.numel() <= COMPILE_MAX_WIDTH else self.model
        )
        out = model(input_ids=ids.view(1, -1), cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def propose(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> Proposal:
        self._base = tokens.shape[0]
        if k <= 0:
            return Proposal(tokens.new_empty(0))
        logits = self._logits(tokens[int(self.cache.get_seq_length()) :])
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

    def batched(self, batch_size: int) -> BatchedModelDraft:
        return BatchedModelDraft(self, batch_size)


class BatchedModelDraft:
    """Greedy chain drafting with a causal LM over the batch; the cache keeps each row's committed tokens."""

    def __init__(self, drafter: ModelDrafter, batch_size: int):
        self.lm = BatchedLM(drafter.model, batch_size, drafter.cache_config, who=f"draft {drafter.name}")
        self.seen = [0] * batch_size  # committed tokens of each row held in the draft cache
        self._base, self._drafted = 0, 0

    def propose(self, tokens: list[list[int]], ks: list[int]) -> list[list[int]]:
        K = max(ks, default=0)
        self._drafted = K
        if K == 0:
            return [[] for _ in tokens]
        ids, valid = pad_rows(
            [t[s:] for t, s in zip(tokens, self.seen)], left=True
        )  # catch up, last slot real
        logits = self.lm.forward(ids, valid, last_only=True)
        self.seen = [len(t) for t in tokens]
        self._base = self.lm.length
        drafted = [logits.argmax(-1)]
        for _ in range(K - 1):
            step = drafted[-1][:, None]
            drafted.append(self.lm.forward(step, torch.ones_like(step, dtype=torch.bool), True).argmax(-1))
        chains = torch.stack(drafted, dim=1).tolist()  # [B, K]
        return [chain[:k] for chain, k in zip(chains, ks)]

    def commit(self, accepted: list[int]) -> None:
        if self._drafted == 0:
            return
        kept = [min(n, self._drafted - 1) for n in accepted]  # the last draft token was never fed
        self.lm.keep(torch.tensor([self._base + n for n in kept]))
        self.seen = [s + n for s, n in zip(self.seen, kept)]

    def select(self, rows: torch.Tensor) -> None:
        self.lm.select(rows)
        self.seen = [self.seen[int(r)] for r in rows]
