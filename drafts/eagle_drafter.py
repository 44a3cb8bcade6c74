"""Chain drafting with an EAGLE head (``drafts/eagle.py``) inside the shared speculative decoder.

The drafter's KV cache holds one entry per pair (feature_t, token_{t+1}). Real pairs use the target's
features; draft pairs use the head's own hidden state in place of the feature. Features of committed
positions whose next token is not known yet wait in ``pending`` until the next ``propose``; ``commit``
drops every draft pair and queues the real features the target just computed for the accepted tokens
(raw: they are fused in one batch at the next ``propose``, so a stretch of plain decoding steps — the
cost model's k = 0 — costs the drafter almost nothing per step).

Tree drafting (``propose_tree``) expands EAGLE-2-style (``decode/tree.py``): level by level, the
``top_k`` best-scored nodes of a depth run through the head together, each attending to the real
pairs and to its own ancestors' draft pairs (a tree mask over the head's cache). Since ``commit``
drops all draft pairs anyway, committing a tree path is committing its length.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.decode.target import rollback_cache
from draftsmith.decode.tree import DraftTree, TreeBuilder, TreeSpec
from draftsmith.drafts.base import DRAFT_KIND_KEY


class EagleDrafter(Drafter):
    """Drafts k tokens chain-wise from an EAGLE head; proposals are over the target's vocabulary."""

    def __init__(self, head: nn.Module, name: str | None = None):
        """``head``: an ``EagleHead`` (``drafts/eagle.py``, which builds drafters from this module, so it is
        not imported here). ``name``: how reports show the drafter; by default the head's kind (``eagle1``,
        ``eagle3``, ``mirror``), so heads of different kinds never share a name."""
        self.head = head
        self.name = name or getattr(head.config, DRAFT_KIND_KEY)
        self.capture_layers = tuple(head.config.capture_layer_ids)
        self.cache: DynamicCache | None = None
        self.pending: torch.Tensor | None = (
            None  # [m, H] fused features of positions cached_len..cached_len+m-1
        )
        self.cached_len = 0  # real pairs in the cache
        self._raw: list[dict[int, torch.Tensor]] = []  # committed features not yet fused into `pending`

    @torch.inference_mode()
    def begin(self, prompt: torch.Tensor, features: dict[int, torch.Tensor] | None) -> None:
        if not features:
            raise ValueError(
                f"the EAGLE drafter needs target features of layers {list(self.capture_layers)}; "
                "set target.set_capture(drafter.capture_layers) before the prefill"
            )
        self.cache = DynamicCache()
        self.cached_len = 0
        self._raw = []
        self.pending = self.head.fuse(features)

    def _step(self, feature: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Append pairs at positions start.. to the cache; hidden states [S, H]."""
        S = ids.shape[0]
        pos = torch.arange(start, start + S, device=ids.device)
        mask = None  # one query attends to everything cached
        if S > 1:  # query i (position start+i) sees cached keys 0..start+i
            mask = (torch.arange(start + S, device=ids.device)[None, :] <= pos[:, None])[None, None]
        return self.head.step(feature[None], ids[None], pos[None], mask, self.cache)[0]

    def _catch_up(
        self,
        tokens: torch.Tensor,
        extra_features: torch.Tensor | None = None,
        extra_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Cache the pending real pairs; the head's hidden state [1, H] that predicts the next token. Draft pairs
        ``extra_features`` [n, H] / ``extra_ids`` [n] run in the same forward after them (their hidden states
        follow, [1 + n, H]); like every draft pair they leave the cache at ``commit``."""
        if self._raw:
            raw = {i: torch.cat([f[i] for f in self._raw]) for i in self._raw[0]}
            self.pending, self._raw = torch.cat([self.pending, self.head.fuse(raw)]), []
        start, m = self.cached_len, self.pending.shape[0]
        next_ids = tokens[start + 1 : start + 1 + m]
        if next_ids.shape[0] != m or start + m != tokens.shape[0] - 1:
            raise RuntimeError(
                f"EAGLE drafter out of step with the decoder: {start + m} positions with features, "
                f"{tokens.shape[0]} tokens (expected one more token than featured positions)"
            )
        feature, ids = self.pending, next_ids
        if extra_ids is not None and extra_ids.numel():
            feature, ids = torch.cat([feature, extra_features.to(feature.dtype)]), torch.cat([ids, extra_ids])
        hidden = self._step(feature, ids, start)[m - 1 :]
        self.cached_len, self.pending = start + m, self.pending[:0]
        return hidden

    @torch.inference_mode()
    def propose(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> Proposal:
        if k <= 0:
            return Proposal(tokens.new_empty(0))
        device = self.head.d2t.device
        hidden = self._catch_up(tokens.to(device))
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
            if i < k - 1:  # the head embeds target ids, as in training
                hidden = self._step(hidden, drafted[-1].view(1), self.cached_len + i)
        return Proposal(torch.stack(drafted), torch.stack(dists) if dists else None)

    def _logprobs(self, hidden: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """Draft log-confidences [m, Vd] that rank tree candidates (-inf where sampling filters a token out)."""
        logits = self.head.draft_logits(hidden).float()
        return logits.log_softmax(-1) if sampling.greedy else to_probs(logits, sampling).log()

    @torch.inference_mode()
    def propose_tree(
        self, tokens: torch.Tensor, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None
    ) -> DraftTree:
        device = self.head.d2t.device
        tokens = tokens.to(device)
        hidden = self._catch_up(tokens)
        builder = TreeBuilder(int(tokens[-1]), device)
        root = torch.zeros(1, dtype=torch.long, device=device)
        level = builder.add_children(root, self._logprobs(hidden, sampling), spec.top_k)
        rows = {0: 0}  # expanded node -> its row in `hiddens` (the root's is the last real pair's)
        hiddens, slots = hidden, []  # slots: expanded nodes, in the order of their draft pairs in the cache
        for depth in range(1, spec.depth):
            frontier = builder.best(level, spec.top_k).tolist()
            if not frontier:
                break
            parents = builder.parents.tolist()
            ancestors = []
            for node in frontier:
                chain, up = set(), parents[node]
                while up > 0:
                    chain.add(up)
                    up = parents[up]
                ancestors.append([slot in chain for slot in slots] + [n == node for n in frontier])
            mask = torch.tensor(ancestors, dtype=torch.bool, device=device)
            mask = torch.cat([mask.new_ones(len(frontier), self.cached_len), mask], dim=1)[None, None]
            feature = hiddens[[rows[parents[n]] for n in frontier]]
            ids = self.head.d2t[builder.tokens[frontier]]  # the head embeds target ids
            pos = torch.full((1, len(frontier)), self.cached_len + depth - 1, device=device)
            out = self.head.step(feature[None], ids[None], pos, mask, self.cache)[0]
            rows.update({n: hiddens.shape[0] + i for i, n in enumerate(frontier)})
            hiddens = torch.cat([hiddens, out])
            slots += frontier
            level = builder.add_children(
                torch.tensor(frontier, device=device), self._logprobs(out, sampling), spec.top_k
            )
        return builder.build(spec.total_tokens, token_map=self.head.d2t)

    @torch.inference_mode()
    def commit(self, num_accepted: int, features: dict[int, torch.Tensor] | None) -> None:
        if not features:
            raise ValueError("the EAGLE drafter needs the target's features at every commit")
        rollback_cache(self.cache, self.cached_len)  # drop draft pairs: real features replace them
        self._raw.append(features)
