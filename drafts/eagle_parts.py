"""The parts of an EAGLE head (``drafts/eagle.py``) that stand on their own, which training imports too.

The draft vocabulary's map to the target's (``build_vocab_map``), the training-time-test attention mask
(``ttt_attention_mask``) and P-EAGLE's one-forward counterpart (``parallel_attention_mask``), the
conversations of a packed row (``packed_segments``), the copy of the target's final norm
(``copy_final_norm``, also Medusa's), EAGLE-3's first layer (``WideInputLayer``), the check of a
vocabulary map as saved (``check_vocab_maps``) and the cut of a trained head's draft vocabulary to its most
frequent rows (``shrink_head_vocab``, ``draftsmith shrink-vocab``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm


def build_vocab_map(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``draft_vocab_size`` most frequent target ids (ties: lower id first).

    Returns ``d2t`` [Vd] int64, the kept target ids in ascending order (draft id i is target id d2t[i]),
    and ``t2d`` [V] bool, True where a target id is in the draft vocabulary. Ascending order makes the
    draft id of a kept target id v equal to ``t2d[:v].sum()``.
    """
    counts = token_counts.reshape(-1).double()
    n = min(int(draft_vocab_size), counts.numel())
    if n < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    kept = torch.sort(counts, descending=True, stable=True).indices[:n]
    d2t = kept.sort().values.long()
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[d2t] = True
    return d2t, t2d


def shrink_head_vocab(head: nn.Module, token_counts: torch.Tensor, draft_vocab_size: int) -> nn.Module:
    """Keep only the ``draft_vocab_size`` most frequent tokens of the draft vocabulary (EAGLE-3).

    Drafting reads the whole draft LM head for every drafted token, and on a weight-bound device that
    product is most of a one-layer head's cost; the rarest rows are seldom the target's choice. The
    kept rows are copied unchanged, so on tokens still in the vocabulary the head ranks as before
    (``token_counts`` [V]: frequencies over target ids, e.g. of the target's own answers; ties keep
    the lower id). The config's ``draft_vocab_size`` follows. In place; returns ``head``.
    """
    with torch.no_grad():
        if not head.config.own_draft_vocab:
            raise ValueError(
                "shrink_vocab needs an EAGLE-3 head with its own LM head over a draft vocabulary"
            )
        current = head.config.draft_vocab_size
        if not 1 <= draft_vocab_size <= current:
            raise ValueError(
                f"draft_vocab_size must be in 1..{current} (this head's), got {draft_vocab_size}"
            )
        counts = token_counts.reshape(-1).double()
        if counts.numel() != head.config.vocab_size:
            raise ValueError(
                f"token_counts has {counts.numel()} entries, the target vocabulary {head.config.vocab_size}"
            )
        order = torch.sort(counts[head.d2t], descending=True, stable=True).indices[:draft_vocab_size]
        keep = order.sort().values  # draft ids in ascending target-id order, as build_vocab_map makes them
        old = head.lm_head
        head.lm_head = nn.Linear(old.in_features, draft_vocab_size, bias=False, device=old.weight.device)
        head.lm_head.weight.copy_(old.weight[keep].to(head.lm_head.weight.dtype))
        head.lm_head.to(old.weight.dtype)
        d2t = head.d2t[keep].clone()
        t2d = torch.zeros_like(head.t2d)
        t2d[d2t] = True
        head.d2t, head.t2d = d2t, t2d  # buffers: assigning a tensor replaces the registered buffer
        head.config.draft_vocab_size = draft_vocab_size
        return head


def ttt_attention_mask(seq_len: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """Mask [T, (step+1)·T] (True = attend) for TTT unroll step ``step``.

    Keys are laid out block by block: block 0 holds step 0 (the real features) at anchors 0..T-1, block
    i the head's own step-i outputs. A query at anchor t sees step-0 keys at anchors <= t (causal) and,
    in every later block, only its own anchor t — the keys chain drafting from anchor t would have cached.
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1)


def parallel_attention_mask(
    keys_ok: torch.Tensor,
    segments: torch.Tensor,
    anchors: torch.Tensor,
    depths: torch.Tensor,
    keep: torch.Tensor,
) -> torch.Tensor:
    """Mask [B, T + S, T + S] (True = attend) of one P-EAGLE training forward: T real pairs, then S slots.

    A real pair t sees real pairs <= t of its conversation (``keys_ok`` [B, T]: real tokens; ``segments``
    [B, T]: conversation index). Slot s of anchor a = ``anchors`` [B, S] at depth d = ``depths`` [B, S] sees
    what decoding gives the slot d after a: the real pairs <= a of a's conversation and the slots of its own
    anchor at depths <= d (itself included). A padding slot (``keep`` False) sees itself alone, no one sees it.
    """
    B, T = keys_ok.shape
    device = keys_ok.device
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    real = (causal & same & keys_ok[:, None, :]) | torch.eye(T, dtype=torch.bool, device=device)
    columns = torch.arange(T, device=device)
    to_real = (
        (columns[None, None, :] <= anchors[..., None])
        & (segments[:, None, :] == segments.gather(1, anchors)[..., None])
        & keys_ok[:, None, :]
        & keep[..., None]
    )  # [B, S, T]
    to_slots = (
        (anchors[:, :, None] == anchors[:, None, :])
        & (depths[:, None, :] <= depths[:, :, None])
        & keep[:, :, None]
        & keep[:, None, :]
    ) | torch.eye(anchors.shape[1], dtype=torch.bool, device=device)  # [B, S, S]
    top = torch.cat([real, real.new_zeros(B, T, anchors.shape[1])], dim=2)
    return torch.cat([top, torch.cat([to_real, to_slots], dim=2)], dim=1)


def copy_final_norm(model: nn.Module, norm: LlamaRMSNorm) -> bool:
    """Copy the target's final RMSNorm into ``norm`` if a Llama RMSNorm can reproduce it; False if not.

    Llama-style norms multiply by w, Gemma-style by (1 + w): a probe finds which one the target uses.
    Shared by every head that reads the target's pre-norm hidden states (EAGLE, Medusa).
    """
    final_norm = getattr(model.get_decoder(), "norm", None)
    if final_norm is None or getattr(final_norm, "weight", None) is None:
        return False
    with torch.no_grad():
        probe = torch.randn(4, norm.weight.shape[0], device=final_norm.weight.device)
        expected = final_norm(probe.to(final_norm.weight.dtype)).float()
        tol = 1e-4 if final_norm.weight.dtype == torch.float32 else 2e-2
        reference = LlamaRMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon).to(probe.device)
        for weight in (final_norm.weight.float(), final_norm.weight.float() + 1):
            reference.weight.copy_(weight)
            if torch.allclose(reference(probe), expected, rtol=tol, atol=tol):
                norm.weight.copy_(weight)
                return True
    return False


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] conversation index within each packed row: a new one starts wherever the position does
    not follow on by one (the same rule transformers applies to packed ``position_ids``)."""
    start = torch.ones_like(position_ids[:, :1], dtype=torch.bool)
    return torch.cat([start, position_ids[:, 1:] != position_ids[:, :-1] + 1], dim=1).long().cumsum(-1)


class WideInputLayer(nn.Module):
    """EAGLE-3's first layer: a stock Llama decoder layer whose q/k/v read [norm_e(emb), norm_f(feature)] (2H)."""

    def __init__(self, config: LlamaConfig, layer_idx: int, norm_before_residual: bool = False,
                 feature_input_norm: bool = False):  # fmt: skip
        super().__init__()
        self.norm_before_residual, self.feature_input_norm = norm_before_residual, feature_input_norm
        self.layer = LlamaDecoderLayer(config, layer_idx)
        attn = self.layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(
                attn, name, nn.Linear(2 * config.hidden_size, old.out_features, bias=old.bias is not None)
            )
        self.feature_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, emb, feature, position_embeddings, attention_mask, cache) -> torch.Tensor:
        normed = self.feature_norm(
            self.layer.input_layernorm(feature) if self.feature_input_norm else feature
        )
        x = torch.cat([self.layer.input_layernorm(emb), normed], dim=-1)
        attn, _ = self.layer.self_attn(
            hidden_states=x,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
        )
        h = (normed if self.norm_before_residual else feature) + attn
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))


def check_vocab_maps(
    d2t: torch.Tensor, t2d: torch.Tensor, vocab: int, offsets: bool, problems: list[str]
) -> None:
    """d2t maps draft ids to distinct target ids (absolute or as offsets) that are exactly t2d's: the check of a
    saved head (``drafts/eagle.py``) and of the engines' layouts (``export/verify.py``)."""
    if d2t.dtype not in (torch.int64, torch.int32) or t2d.dtype != torch.bool:
        problems.append(f"d2t must be an integer tensor and t2d bool; got {d2t.dtype}, {t2d.dtype}")
        return
    targets = d2t.long() + (torch.arange(d2t.numel()) if offsets else 0)
    spelled = "d2t[i] + i" if offsets else "d2t[i]"
    if targets.numel() and (targets.min() < 0 or targets.max() >= vocab):
        problems.append(
            f"{spelled} leaves the target vocabulary 0..{vocab - 1} (are the ids absolute, not offsets?)"
        )
        return
    if targets.unique().numel() != targets.numel():
        problems.append(f"{spelled} maps two draft ids to one target id")
    if not torch.equal(targets.sort().values, t2d.nonzero().flatten()):
        problems.append(f"the target ids {spelled} do not match t2d's (offsets vs absolute ids mixed up?)")
