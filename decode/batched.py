"""Greedy speculative decoding of several prompts at once (batch > 1), for offline evaluation throughput.

Layout: every model (the target, and a causal-LM draft) keeps one KV cache for the whole batch, all
rows the same number of *slots* long. A per-row ``valid`` mask says which slots hold a real token
of that row: prompts are left-padded, and when rows accept different numbers of draft tokens the
cache is cropped to the longest row and the rejected slots of the others are masked out (a hole).
Positions (RoPE) count only valid slots, and attention sees only valid earlier slots, so each row
computes what it would compute alone. Every query also sees its own slot, which keeps padding
queries finite (a fully masked row would give NaN keys and values that poison later steps).

Supported drafts: ``ngram`` and independent causal-LM drafts (``layers:N``, a model path); models
with sliding-window or other non-global attention layers are refused (their caches drop slots by
count, which holes would break). Finished rows leave the batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from draftsmith.decode.speculative import GenerationResult
from draftsmith.decode.target import Target, rollback_cache
from draftsmith.decode.verify import verify_greedy
from draftsmith.drafts.base import Drafter, build_drafter
from draftsmith.drafts.model_drafter import ModelDrafter
from draftsmith.drafts.ngram import NgramDrafter, lookup

PAD_ID = 0
"""Token id written into padding slots; they are masked, so any valid id does."""


def check_global_attention(config, who: str) -> None:
    """Refuse models whose cache is not one global-attention cache per layer."""
    config = config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    local = sorted({t for t in layer_types or () if t != "full_attention"})
    if local or (layer_types is None and getattr(config, "sliding_window", None)):
        raise ValueError(
            f"batched decoding needs global attention in every layer, but {who} ({config.model_type}) has "
            f"{', '.join(local) or 'sliding-window'} layers; decode it one sequence at a time with "
            "draftsmith.decode.speculative.generate"
        )


class BatchedLM:
    """A causal LM over a batch of rows: one KV cache plus ``valid`` [B, L] (True = a real token of that row)."""

    def __init__(self, model: torch.nn.Module, batch_size: int, cache_config=None, who: str = "model"):
        check_global_attention(cache_config if cache_config is not None else model.config, who)
        self.model = model
        self.cache = DynamicCache(config=cache_config if cache_config is not None else model.config)
        device = next(model.parameters()).device
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def forward(self, ids: torch.Tensor, valid: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append slots ids [B, S] (valid [B, S]); logits [B, S, V] (or [B, V] of the last slot), float32."""
        B, S = ids.shape
        L, device = self.length, self.valid.device
        ids, valid = ids.to(device), valid.to(device)
        keys_valid = torch.cat([self.valid, valid], dim=1)  # [B, L + S]
        positions = (self.valid.sum(1, keepdim=True) + valid.long().cumsum(1) - 1).clamp_min(0)
        slot = torch.arange(L + S, device=device)
        query = slot[L:, None]  # [S, 1]
        allowed = (slot[None] <= query)[None] & keys_valid[:, None, :]  # causal over slots, valid keys only
        allowed |= (slot[None] == query)[None]  # a query always sees itself
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
        out = self.model(
            input_ids=ids,
            attention_mask=mask[:, None],
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        self.valid = keys_valid
        return out.logits[:, -1].float() if last_only else out.logits.float()

    def keep(self, lengths: torch.Tensor) -> None:
        """Row b keeps only its slots before ``lengths[b]``; the cache is cropped to the longest row."""
        lengths = lengths.to(self.valid.device)
        self.valid &= torch.arange(self.length, device=self.valid.device)[None] < lengths[:, None]
        longest = int(lengths.max()) if lengths.numel() else 0
        rollback_cache(self.cache, longest)
        self.valid = self.valid[:, :longest]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (indices into the current batch)."""
        self.cache.batch_select_indices(rows.to(self.valid.device))
        self.valid = self.valid[rows.to(self.valid.device)]


def _pad(rows: Sequence[Sequence[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows → ids [B, S] and valid [B, S], padded on the left or the right."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[b, span] = torch.tensor(list(row), dtype=torch.long)
        valid[b, span] = True
    return ids, valid


class _BatchedNgram:
    def __init__(self, drafter: NgramDrafter):
        self.max_n, self.min_n = drafter.max_n, drafter.min_n

    def propose(self, tokens: list[list[int]], ks: list[int]) -> list[list[int]]:
        return [lookup(torch.tensor(t), k, self.max_n, self.min_n).tolist() for t, k in zip(tokens, ks)]

    def commit(self, accepted: list[int]) -> None:
        pass

    def select(self, rows: torch.Tensor) -> None:
        pass


class _BatchedModelDraft:
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
        ids, valid = _pad([t[s:] for t, s in zip(tokens, self.seen)], left=True)  # catch up, last slot real
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


def _batched_drafter(target: Target, drafter: str | Drafter | None, batch_size: int):
    if drafter is None:
        return None
    if isinstance(drafter, str):
        drafter = build_drafter(drafter, target)
    if isinstance(drafter, NgramDrafter):
        return _BatchedNgram(drafter)
    if type(drafter) is ModelDrafter:
        return _BatchedModelDraft(drafter, batch_size)
    raise ValueError(
        f"batched decoding supports n-gram and causal-LM drafts (ngram, layers:N, a model path), not "
        f"{getattr(drafter, 'name', type(drafter).__name__)!r}; decode with it one sequence at a time "
        "(draftsmith.decode.speculative.generate)"
    )


@dataclass
class BatchResult:
    """One GenerationResult per prompt (tokens, accepted/proposed/chosen_k per step, target_forwards,
    stopped_by; their timing fields stay 0) and the batch's own timing."""

    sequences: list[GenerationResult]
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    target_forwards: int = 0
    """Batched target passes, prefill included."""

    @property
    def new_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.sequences)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@torch.inference_mode()
def generate_batch(
    target: Target,
    prompts: Sequence[torch.Tensor],
    drafter: str | Drafter | None = None,
    k: int = 5,
    max_new_tokens: int = 256,
) -> BatchResult:
    """Greedy decoding of every prompt (token ids [S_b]) together; each sequence equals its unbatched output.

    ``drafter``: None (the target alone), a spec (``ngram``, ``ngram:N``, ``layers:N``, a model path)
    or a built n-gram / causal-LM drafter. Up to k draft tokens per row and step.
    """
    if not prompts:
        raise ValueError("generate_batch needs at least one prompt")
    if any(p.numel() == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if k < 0 or max_new_tokens < 1:
        raise ValueError(f"need k >= 0 and max_new_tokens >= 1, got k={k}, max_new_tokens={max_new_tokens}")
    for p in prompts:
        target.check_fits(p.numel(), max_new_tokens)
    start = time.perf_counter()
    draft = _batched_drafter(target, drafter, len(prompts))
    lm = BatchedLM(target.model, len(prompts), who=f"target {target.name}")
    tokens = [p.view(-1).tolist() for p in prompts]
    results = [GenerationResult(tokens=[]) for _ in prompts]
    active = list(range(len(prompts)))  # sequence index of each batch row

    ids, valid = _pad(tokens, left=True)
    first = lm.forward(ids, valid, last_only=True).argmax(-1).tolist()
    prefill_seconds = time.perf_counter() - start
    forwards = 1
    finished = []
    for b, tok in enumerate(first):
        tokens[b].append(tok)
        results[b].tokens.append(tok)
        results[b].target_forwards = 1
        if tok in target.eos_ids or max_new_tokens == 1:
            results[b].stopped_by = "eos" if tok in target.eos_ids else "length"
            finished.append(b)

    while True:
        active = _drop_finished(active, finished, lm, draft)
        if not active:
            break
        ks = [min(k, max_new_tokens - len(results[s].tokens) - 1) for s in active]
        drafts = draft.propose([tokens[s] for s in active], ks) if draft is not None else [[] for _ in active]
        ids, valid = _pad([[tokens[s][-1], *d] for s, d in zip(active, drafts)], left=False)
        before = lm.length
        logits = lm.forward(ids, valid)  # [A, 1 + K, V]: row b scores its drafts at 0..len-1
        forwards += 1
        accepted, finished = [], []
        for row, (s, d) in enumerate(zip(active, drafts)):
            drafted = torch.tensor(d, dtype=torch.long, device=logits.device)
            n, nxt = verify_greedy(drafted, logits[row, : len(d) + 1])
            accepted.append(n)
            res = results[s]
            res.accepted.append(n)
            res.proposed.append(len(d))
            res.chosen_k.append(ks[row])
            res.target_forwards += 1
            new = d[:n] + [nxt]
            eos = next((i for i, t in enumerate(new) if t in target.eos_ids), None)
            if eos is not None:
                new, res.stopped_by = new[: eos + 1], "eos"
            tokens[s].extend(new)
            res.tokens.extend(new)
            if eos is not None or len(res.tokens) >= max_new_tokens:
                finished.append(row)
        lm.keep(torch.tensor([before + n + 1 for n in accepted]))  # the last token + accepted drafts
        if draft is not None:
            draft.commit(accepted)
    return BatchResult(results, time.perf_counter() - start, prefill_seconds, forwards)


def _drop_finished(active: list[int], finished: list[int], lm: BatchedLM, draft) -> list[int]:
    """Remove finished batch rows from the batch and every cache; the sequence ids of the remaining rows."""
    if not finished:
        return active
    rows = [r for r in range(len(active)) if r not in set(finished)]
    if rows:
        index = torch.tensor(rows, dtype=torch.long)
        lm.select(index)
        if draft is not None:
            draft.select(index)
    return [active[r] for r in rows]
