"""The ``mirror`` draft kind: an EAGLE-3-shaped head that reads the target's early-exit layer.

Mirror decoding (``decode/mirror.py``) gives the draft only what the target has computed by its
early-exit layer ℓe when the draft must start: that layer's output h and the top-κ tokens the target's
LM head reads from it. So the head is trained on layer ℓe alone (``capture_layer_ids = [ℓe]``), by the
EAGLE-3 objective with its TTT unroll (``train/objectives/eagle.py``, kind ``mirror``), and its
``config.json`` keeps ℓe, κ and γ beside the target record. Chain drafting (``propose``) is the EAGLE
drafter's; ``rollout`` drafts the hypothesis grid — a γ-token branch after every early-exit candidate
at every verify position — in γ batched head steps, each branch attending to the committed pairs, to
the proposal's pairs before its depth and to its own.

No serving engine runs mirror decoding, so the kind exports to draftsmith's own layout only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.decode.drafter import Drafter
from draftsmith.decode.mirror import Grid, MirrorSettings
from draftsmith.decode.sampling import Sampling, to_probs
from draftsmith.decode.target import rollback_cache
from draftsmith.drafts.base import MIRROR, DraftKind, register
from draftsmith.drafts.eagle import EAGLE, EagleHead, load_head
from draftsmith.drafts.eagle_drafter import EagleDrafter
from draftsmith.drafts.engines import HF


def mirror_settings(config) -> MirrorSettings:
    """The settings a mirror head's config records; a clear error for a head that is not one."""
    saved = getattr(config, "mirror", None)
    if not saved:
        raise ValueError(
            "this EAGLE head records no early-exit layer: it is not a mirror draft (train one with "
            "draft.kind: mirror)"
        )
    settings = MirrorSettings(int(saved["early_exit_layer"]), int(saved["kappa"]), int(saved["gamma"]))
    if list(config.capture_layer_ids) != [settings.early_exit_layer]:
        raise ValueError(
            f"a mirror head reads its early-exit layer alone, but this one records capture layers "
            f"{config.capture_layer_ids} and early-exit layer {settings.early_exit_layer}"
        )
    return settings


class MirrorDrafter(EagleDrafter):
    """EAGLE chain drafting plus the hypothesis grid of mirror decoding (it is a ``GridDrafter``)."""

    def __init__(self, head: EagleHead, name: str | None = None):
        super().__init__(head, name)
        self.mirror = mirror_settings(head.config)

    @torch.inference_mode()
    def rollout(
        self,
        tokens: torch.Tensor,
        drafted: torch.Tensor,
        exit_hidden: torch.Tensor,
        candidates: torch.Tensor,
        gamma: int,
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> Grid:
        device = self.head.d2t.device
        tokens, drafted = tokens.to(device), drafted.to(device)
        rollback_cache(self.cache, self.cached_len)  # a fresh proposal's draft pairs
        if self._raw or self.pending.shape[0]:
            self._catch_up(tokens)  # committed pairs, up to the pair that predicts tokens[-1]
        base, n = self.cached_len, drafted.shape[0]  # base: the position of tokens[-1]
        fused = self.head.fuse({self.mirror.early_exit_layer: exit_hidden.to(device)})  # [n + 1, H]
        if n:  # the proposal's pairs (h_i, d_{i+1}): every branch deeper than i attends to them
            self._step(fused[:n], drafted, base)
        kappa = candidates.shape[1]
        depths = torch.arange(n + 1, device=device).repeat_interleave(kappa)  # [R]
        rows = depths.shape[0]
        # keys: committed pairs, the proposal's n pairs, then one block of R pairs per rollout step
        sees_proposal = torch.arange(n, device=device)[None, :] < depths[:, None]  # [R, n]
        own = torch.eye(rows, dtype=torch.bool, device=device)
        feature, ids = fused[depths], candidates.to(device).reshape(-1)
        drawn, dists = [], []
        for s in range(gamma):
            mask = torch.cat([sees_proposal.new_ones(rows, base), sees_proposal, *([own] * (s + 1))], dim=1)
            hidden = self.head.step(
                feature[None], ids[None], (base + depths + s)[None], mask[None, None], self.cache
            )[0]
            logits = self.head.draft_logits(hidden).float()  # [R, Vd]
            if sampling.greedy:
                pick = logits.argmax(-1)
            else:
                q = to_probs(logits, sampling)
                pick = torch.multinomial(q, 1, generator=generator).view(-1)
                dists.append(q)
            drawn.append(self.head.d2t[pick])
            feature, ids = hidden, drawn[-1]  # the head embeds target ids, as in training
        rollback_cache(self.cache, base)  # the grid's pairs and the proposal's: commit brings real ones
        return Grid(
            depths,
            candidates.to(device).reshape(-1),
            torch.stack(drawn, dim=1),
            torch.stack(dists, dim=1) if dists else None,  # [R, γ, Vd]: what verify needs of a reused branch
            self.head.d2t,
            self.head.config.vocab_size,
        )


def _build(target, path: str) -> Drafter:
    return MirrorDrafter(load_head(target, path, "a mirror draft"), name=f"mirror:{Path(path).name}")


register(
    DraftKind(
        MIRROR,
        "mirror draft (EAGLE-3 head on the target's early exit)",
        _build,
        EAGLE,
        exports=(HF,),
        refusal="no serving engine runs mirror decoding (early-exit candidates and branch reuse); evaluate it "
        "with `draftsmith eval`, or train an eagle3 head for serving",
    )
)
