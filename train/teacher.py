"""The frozen target's outputs for a training batch (online mode, and the source of the offline cache).

One no-grad forward of the stock model over the padded batch, with forward hooks capturing the
layers the objective asked for; only the top-k logits per position are kept, since the full
[B, T, V] logits are by far the largest tensor and no loss needs more than the head of them.
An offline cache of the last layer's output instead of logits (``cache.teacher: final_state``) gets its
top-k in every step from ``teacher_from_final_state``: the target's final norm and LM head on that state.
"""

from __future__ import annotations

import torch

from draftsmith.decode.features import capture_layers, final_norm
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


def final_layer(target: Target) -> int:
    """The id of the target's last decoder layer, whose output (before the final norm) a ``final_state``
    cache keeps for the teacher."""
    return int(target.config.num_hidden_layers) - 1


@torch.no_grad()
def head_logits(target: Target, final_state: torch.Tensor) -> torch.Tensor:
    """[..., V] next-token logits from the last layer's output [..., H]: the target's final norm, LM head and
    logit soft-capping where it has one (Gemma 2), as its own forward applies them."""
    model = target.model
    logits = model.get_output_embeddings()(final_norm(model)(final_state))
    cap = getattr(target.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
def teacher_from_final_state(
    target: Target, teacher: Teacher, layers: tuple[int, ...] | list[int], topk: int
) -> Teacher:
    """The teacher a logits cache would hold, from a ``final_state`` cache's: the top-``topk`` of
    ``head_logits`` over the cached last layer, and only the ``layers`` the objective reads kept as features.

    This is the target-head work SpecForge's ``TargetHead`` and speculators' ``verifier_norm`` + ``lm_head``
    do in every offline step (one [T, H] x [H, V] product per row)."""
    features = {i: teacher.features[i] for i in layers}
    if topk <= 0:
        return Teacher(features=features)
    values, ids = topk_logits(head_logits(target, teacher.features[final_layer(target)]), topk)
    return Teacher(features=features, topk_logits=values, topk_ids=ids)
