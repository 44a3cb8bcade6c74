"""Greedy speculative decoding of several prompts at once (batch > 1), for offline evaluation throughput.

Layout: every model (the target, and a causal-LM draft) keeps one KV cache for the whole batch, all
rows the same number of *slots* long. A per-row ``valid`` mask says which slots hold a real token
of that row: prompts are left-padded, and when rows accept different numbers of draft tokens the
cache is cropped to the longest row and the rejected slots of the others are masked out (a hole).
Positions (RoPE) count only valid slots, and attention sees only valid earlier slots, so each row
computes what it would compute alone. Every query also sees its own slot, which keeps padding
queries finite (a fully masked row would give NaN keys and values that poison later steps).

Drafts: whatever ``Drafter.batched`` gives (n-gram lookup, causal-LM drafts: ``drafts/ngram.py``,
``drafts/model_drafter.py``); models with sliding-window or other non-global attention layers are
refused (their caches drop slots by count, which holes would break). Finished rows leave the batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from draftsmith.decode.drafter import BatchedDrafter, Drafter
from draftsmith.decode.speculative import GenerationResult
from draftsmith.decode.target import Target, rollback_cache
from draftsmith.decode.verify import verify_greedy

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


def pad_rows(rows: Sequence[Sequence[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows → ids [B, S] and valid [B, S], padded on the left or the right."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[b, span] = torch.tensor(list(row), dtype=torch.long)
        valid[b, span] = True
    return ids, valid


def _batched_drafter(drafter: Drafter | None, batch_size: int) -> BatchedDrafter | None:
    if drafter is None:
        return None
    batched = drafter.batched(batch_size)
    if batched is None:
        raise ValueError(
            f"drafter {getattr(drafter, 'name', type(drafter).__name__)!r} has no batched form (batched decoding "
            "drafts with n-gram lookup and causal-LM drafts: ngram, layers:N, a distilled draft; heads that read "
            "the target's hidden states need features the batched target does not capture); decode with it one "
            "sequence at a time (draftsmith.decode.speculative.generate)"
        )
    return batched


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
    drafter: Drafter | None = None,
    k: int = 5,
    max_new_tokens: int = 256,
) -> BatchResult:
    """Greedy decoding of every prompt (token ids [S_b]) together; each sequence equals its unbatched output.

    ``drafter``: None (the target alone) or a drafter with a batched form (``Drafter.batched``: n-gram
    lookup, causal-LM drafts). Up to k draft tokens per row and step.
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
    draft = _batched_drafter(drafter, len(prompts))
    lm = BatchedLM(target.model, len(prompts), who=f"target {target.name}")
    tokens = [p.view(-1).tolist() for p in prompts]
    results = [GenerationResult(tokens=[]) for _ in prompts]
    active = list(range(len(prompts)))  # sequence index of each batch row

    ids, valid = pad_rows(tokens, left=True)
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
        ids, valid = pad_rows([[tokens[s][-1], *d] for s, d in zip(active, drafts)], left=False)
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
