"""The frozen target's outputs for a training batch (online mode, and the source of the offline cache).

One no-grad forward of the stock model over the padded batch, with forward hooks capturing the
layers the objective asked for; only the top-k logits per position are kept, since the full
[B, T, V] logits are by far the largest tensor and no loss needs more than the head of them.
"""

from __future__ import annotations

import torch

from draftsmith.decode.features import capture_layers
from draftsmith.decode.target import Target
from draftsmith.train.objective import Batch, Teacher


def topk_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([..., K] largest logits in float32, [..., K] their ids); K >= V keeps all logits in vocab order."""
    vocab = logits.shape[-1]
    if k >= vocab:
        ids = torch.arange(vocab, device=logits.device).expand(logits.shape)
        return logits.float(), ids
    values, ids = logits.topk(k, dim=-1)
    return values.float(), ids


@torch.no_grad()  # not inference_mode: features feed the draft's autograd graph as constants
def compute_teacher(target: Target, batch: Batch, layers: tuple[int, ...] | list[int], topk: int) -> Teacher:
    """Teacher for ``batch``: {layer: [B, T, H]} in the target's dtype and top-``topk`` logits [B, T, K]."""
    model = target.model
    device = target.device
    input_ids = batch.input_ids.to(device)
    kwargs = {"attention_mask": batch.attention_mask.to(device), "use_cache": False}
    position_ids = getattr(batch, "position_ids", None)
    if position_ids is not None:
        # Packed rows: positions restart at each conversation. With position_ids and no 2-D mask,
        # transformers builds a block-diagonal causal mask, so conversations do not see each other
        # (trailing padding has position 0 and becomes one-token blocks, masked out of every loss).
        kwargs = {"position_ids": position_ids.to(device), "use_cache": False}
    with capture_layers(model, list(layers)) as store:
        out = model(input_ids=input_ids, **kwargs)
        features = dict(store)  # keyed by resolved (non-negative) layer ids
    if topk > 0:
        values, ids = topk_logits(out.logits, topk)
        return Teacher(features=features, topk_logits=values, topk_ids=ids)
    return Teacher(features=features)
