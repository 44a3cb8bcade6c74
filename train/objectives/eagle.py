"""EAGLE-1, EAGLE-3 and mirror objectives: the head of ``drafts/eagle.py`` trained on the target's features.

A mirror draft (``drafts/mirror.py``) is trained exactly as an EAGLE-3 head, on the target's early-exit
layer alone: that layer's output is all mirror decoding gives the draft when it must start.

Alignment. The head at anchor t reads the target feature at t and the token at t+1 (step 0), or its own
step-(j-1) output and the token at t+1+j (step j). Step j stands in for target position p = t+1+j: it is
scored against the target's next-token distribution at p (``Teacher.topk_*`` at p) and, for EAGLE-1,
regresses the target feature at p. It counts iff token t is real and the token it predicts, p+1, is a
learnt token (``loss_mask``); each step's loss is a mean over its counted positions.

Teacher. ``teacher_topk = 64``: the target's 64 largest logits per position, renormalised, are the soft
target — almost all of the target's mass for a chat model, without a full-vocabulary product.
EAGLE-3 keeps only the teacher ids inside the draft vocabulary and renormalises over them. A position
whose target greedy token is outside the draft vocabulary can never be drafted right: it is left out
of ``acc_j`` (logged as ``oov_frac``) but still trains on the in-vocabulary mass; a position with no
in-vocabulary mass in the top-k is left out of the loss.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, NonNegativeFloat
from pydantic.dataclasses import dataclass
from torch import nn

from draftsmith.decode.features import decoder_layers, resolve_layer_ids
from draftsmith.decode.mirror import MirrorSettings
from draftsmith.drafts.base import DRAFT_KIND_KEY, EAGLE1, EAGLE3, MIRROR
from draftsmith.drafts.eagle import EagleConfig, EagleHead, check_target
from draftsmith.drafts.eagle_parts import build_vocab_map
from draftsmith.train.losses import (
    dpace_weights,
    lk_hybrid,
    soft_topk_cross_entropy,
    teacher_entropy,
    topk_acceptance,
)
from draftsmith.train.objective import Batch, Objective, Teacher, feature_noise
from draftsmith.train.objectives.common import (
    chain_starts,
    masked_mean,
    shift_left,
    step_valid_masks,
    teacher_greedy,
)
from draftsmith.train.registry import register_objective
from draftsmith.train.schema import SECTION

__all__ = ["Eagle1Objective", "Eagle3Objective", "EagleObjective", "MirrorObjective"]

DEFAULT_TTT_STEPS = {EAGLE1: 1, EAGLE3: 3}
"""EAGLE-3's paper unrolls 7 steps; 3 keeps CPU training fast and already covers most accepted chains."""


@dataclass(config=SECTION)
class EagleOptions:
    """``draft.options`` of ``eagle1`` (and the first of ``eagle3``'s): the one declaration of each option,
    which ``EagleObjective`` receives whole."""

    num_layers: Annotated[int, Field(ge=1)] | None = None
    """Decoder layers in the head (null = 1, or the continued head's with init_from)."""
    capture_layer_ids: list[int] | None = None
    """Target layers the head reads (0-based outputs, negatives count from the top; null = the last layer for
    EAGLE-1, low / middle / high for EAGLE-3)."""
    draft_vocab_size: Annotated[int, Field(ge=1)] | None = None
    """EAGLE-3's draft vocabulary: the most frequent tokens of the training data (null = 32000; at most the
    target's vocabulary, which needs no map)."""
    ttt_steps: Annotated[int, Field(ge=1)] | None = None
    """Training-time-test unroll steps (null = 1 for EAGLE-1, 3 for EAGLE-3; EAGLE-3's paper uses 7)."""
    step_decay: float = 0.8
    """Weight of unroll step j is step_decay ** j (step_weighting: decay)."""
    teacher_topk: Annotated[int, Field(ge=1)] = 64
    """The target's largest logits per position the soft targets are made of."""
    feature_weight: float = 1.0
    """EAGLE-1: weight of the smooth-L1 regression of the target's feature."""
    token_weight: float = 0.1
    """EAGLE-1: weight of the cross-entropy term."""
    init_from: str | None = None
    """A head directory saved by `draftsmith train` to continue from (its shape, layers and draft vocabulary
    are kept)."""
    freeze_lm_head: bool = False
    """EAGLE-3: keep the LM head as it starts, the target's own rows at the draft vocabulary (or the continued
    head's), instead of training it; speculators trains its heads so. EAGLE-1's is always the target's."""
    feature_noise: NonNegativeFloat = 0.0
    """Uniform noise in [-feature_noise, feature_noise] added to the target's hidden states the head reads, in
    training steps only (EAGLE-1's paper 0.1, speculators 0.05): the head learns to read slightly wrong
    features, as it must from its own at the later steps of a chain."""


@dataclass(config=SECTION)
class Eagle3Options(EagleOptions):
    """``draft.options`` of ``eagle3``: EAGLE-1's, and the EAGLE-3.1 norms (EAGLE 3.1, arXiv 2605.09992)."""

    norm_before_fc: bool = False
    """EAGLE-3.1: one RMSNorm over the concatenated target states before fc (the taps' scales differ by
    orders of magnitude between low and high layers)."""
    norm_output: bool = False
    """EAGLE-3.1: the hidden state fed back to the next step is the final norm's output, not the pre-norm
    residual stream, so every step reads a state of the same scale."""
    norm_before_residual: bool = False
    """EAGLE-3.1: the first layer's residual stream starts from hidden_norm(feature), not the raw feature."""
    step_weighting: Literal["decay", "dpace", "walk"] = "decay"
    """How the TTT steps of one anchor are weighed: decay (step_decay ** j), dpace (D-PACE, arXiv 2605.18810:
    step j by the chance, from the draft's probability of the target's token at the steps before it, that decoding
    reaches it and the steps after), walk (D-PACE with the draft's greedy hits as the chance: the steps the greedy
    decoding walk reaches); dpace and walk sum over an anchor's steps and average over anchors."""
    dpace_alpha: Annotated[float, Field(gt=0, le=1)] = 0.5
    """D-PACE's floor α of a step's chance (step_weighting: dpace, walk): q̃ = (1 - α)·q + α; at 1 step j
    weighs ttt_steps - j whatever the draft's chances."""
    loss: Literal["kl", "lk_hybrid"] = "kl"
    """Per-position loss against the target's top-k over the draft vocabulary: kl (forward KL, in fp32; the
    soft cross-entropy's gradient), lk_hybrid (LK^λ, arXiv 2602.23881: λ·KL + (1 - λ)·(1 - acceptance),
    λ = exp(-3·acceptance))."""


@dataclass(config=SECTION)
class MirrorOptions(Eagle3Options):
    """``draft.options`` of ``mirror``: EAGLE-3's, on the early-exit layer alone, and the decoding defaults."""

    early_exit_layer: int | None = None
    """The target layer the draft reads and mirror decoding exits at (null = two thirds of the way up)."""
    kappa: Annotated[int, Field(ge=1)] = 4
    """Early-exit candidates per position, recorded as the draft's decoding default."""
    gamma: Annotated[int, Field(ge=1)] = 4
    """Tokens per branch, recorded as the draft's decoding default."""


def load_head_to_continue(
    path: str,
    target,
    preset: str,
    num_layers: int | None,
    capture_layer_ids: list[int] | None,
    draft_vocab_size: int | None,
) -> EagleHead:
    """Load a saved head to train further, refusing one made for another target or of another shape."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(
            f"draft.options.init_from: {path!r} is not a head directory saved by `draftsmith train` "
            "(no config.json); point it at a run's draft/ folder"
        )
    head = EagleHead.from_pretrained(path, dtype=torch.float32)
    cfg = head.config
    check_target(cfg, target)
    if cfg.preset != preset:
        raise ValueError(
            f"draft.options.init_from: the head at {path} is {cfg.preset!r} but draft.kind is {preset!r}; "
            f"set draft.kind: {cfg.preset}"
        )
    wanted = {
        "num_layers": (num_layers, cfg.num_decoder_layers),
        "capture_layer_ids": (
            None if capture_layer_ids is None else resolve_layer_ids(target.model, list(capture_layer_ids)),
            list(cfg.capture_layer_ids),
        ),
        "draft_vocab_size": (draft_vocab_size, cfg.draft_vocab_size),
    }
    for key, (asked, saved) in wanted.items():
        if asked is not None and asked != saved:
            raise ValueError(
                f"draft.options.init_from: the head at {path} has {key} = {saved!r} but the config asks for "
                f"{asked!r}; drop {key} from draft.options (the loaded head's is used) or train from scratch"
            )
    return head


def _unwrap(draft: nn.Module) -> EagleHead:
    """The EagleHead inside a DDP / compiled wrapper."""
    while not isinstance(draft, EagleHead):
        inner = getattr(draft, "module", None)
        inner = getattr(draft, "_orig_mod", None) if inner is None else inner
        if not isinstance(inner, nn.Module):
            raise TypeError(f"expected an EagleHead (possibly wrapped), got {type(draft).__name__}")
        draft = inner
    return draft


class EagleObjective(Objective):
    """EAGLE head + loss; ``preset`` is ``eagle1`` or ``eagle3`` (see the module docstring)."""

    kind = "eagle"

    def __init__(
        self,
        target,
        options: EagleOptions | None = None,
        token_counts: torch.Tensor | None = None,
        preset: str = EAGLE3,
    ):
        """``options``: the kind's ``draft.options``, checked and filled in by its class (``EagleOptions`` for
        EAGLE-1, ``Eagle3Options`` for EAGLE-3: each option's default, range and meaning, as ``train --help``
        shows them); EAGLE-1's options are EAGLE-3's less the EAGLE-3-only ones, which keep their defaults.
        ``token_counts``: the training data's token counts over the target's vocabulary (a reduced draft
        vocabulary is built from them). With ``init_from``, the continued head's shape, capture layers and
        draft vocabulary are kept; asking for others is an error. From scratch: 1 layer, 32,000 draft tokens.
        """
        if preset not in DEFAULT_TTT_STEPS:
            raise ValueError(f"unknown EAGLE preset {preset!r}; choose one of {', '.join(DEFAULT_TTT_STEPS)}")
        o = Eagle3Options() if options is None else options
        if not isinstance(o, Eagle3Options):  # EAGLE-1's: the EAGLE-3-only options at their defaults
            o = Eagle3Options(**dataclasses.asdict(o))
        self.options = o
        steps = DEFAULT_TTT_STEPS[preset] if o.ttt_steps is None else o.ttt_steps
        num_layers, capture_layer_ids, draft_vocab_size = (
            o.num_layers,
            o.capture_layer_ids,
            o.draft_vocab_size,
        )
        init_from = o.init_from
        variants = {key: getattr(o, key) for key in ("norm_before_fc", "norm_output", "norm_before_residual")}
        if preset != EAGLE3 and any(variants.values()):
            raise ValueError(
                f"{', '.join(k for k, v in variants.items() if v)}: EAGLE-3 head variants; {preset} has none"
            )
        self.target = target
        self.init_head: EagleHead | None = None
        if init_from is not None:
            self.init_head = load_head_to_continue(
                init_from, target, preset, num_layers, capture_layer_ids, draft_vocab_size
            )
            self.config = copy.deepcopy(self.init_head.config)
            self.config.ttt_steps = steps
            for key, asked in variants.items():
                if asked and not getattr(self.config, key):
                    raise ValueError(
                        f"draft.options.{key}: the head at {init_from} was trained without it, and a norm cannot "
                        f"be added to a trained head; drop {key} or train from scratch"
                    )
        else:
            self.config = EagleConfig.for_target(
                target,
                preset,
                1 if num_layers is None else num_layers,
                capture_layer_ids,
                32000 if draft_vocab_size is None else draft_vocab_size,
                steps,
            )
            for key, asked in variants.items():
                setattr(self.config, key, bool(asked))
        self.feature_noise = o.feature_noise
        self.capture_layers = tuple(self.config.capture_layer_ids)
        self.teacher_topk = o.teacher_topk
        self.step_weights = [o.step_decay**j for j in range(steps)]
        self.step_weighting, self.dpace_alpha, self.loss_name = o.step_weighting, o.dpace_alpha, o.loss
        self.feature_weight, self.token_weight = o.feature_weight, o.token_weight
        self.freeze_lm_head = o.freeze_lm_head
        self.vocab_map = None
        reduced = preset == EAGLE3 and self.config.draft_vocab_size < self.config.vocab_size
        if reduced and self.init_head is None:  # a loaded head brings its own vocabulary map
            if token_counts is None:
                raise ValueError(
                    f"EAGLE-3 with a draft vocabulary of {self.config.draft_vocab_size} < {self.config.vocab_size} "
                    "needs token_counts (frequencies [V] of the learnt tokens of the training data); "
                    "or set draft_vocab_size to the target's vocabulary size"
                )
            if token_counts.numel() != self.config.vocab_size:
                raise ValueError(
                    f"token_counts has {token_counts.numel()} entries, target vocabulary has {self.config.vocab_size}"
                )
            self.vocab_map = build_vocab_map(token_counts, self.config.draft_vocab_size)

    @property
    def preset(self) -> str:
        return self.config.preset

    def build_draft(self) -> EagleHead:
        if self.init_head is not None:
            head = copy.deepcopy(self.init_head).train()  # from_pretrained returns eval mode
            head.freeze_target_copies()  # loading made every parameter trainable again
            head.config = copy.deepcopy(self.config)  # this run's ttt_steps
            return self._freeze_head(head, True)
        head = EagleHead(copy.deepcopy(self.config))
        if self.vocab_map is not None:
            head.set_vocab_map(*self.vocab_map)
        return self._freeze_head(head, head.init_from_target(self.target.model))

    def _freeze_head(self, head: EagleHead, head_is_set: bool) -> EagleHead:
        """``head`` with its LM head frozen where ``freeze_lm_head`` asks (``head_is_set``: it holds the
        target's rows or a continued head's, not a fresh initialisation)."""
        if not self.freeze_lm_head or head.config.lm_head_is_embedding:
            return head
        if not head_is_set:
            raise ValueError(
                f"draft.options.freeze_lm_head keeps the LM head the target's, but "
                f"{type(self.target.model).__name__}'s final norm is not an RMSNorm the head can reproduce, so "
                "its LM head starts fresh and must train: set freeze_lm_head: false"
            )
        head.lm_head.requires_grad_(False)
        return head

    def loss(self, draft: nn.Module, batch: Batch, teacher: Teacher) -> dict[str, torch.Tensor]:
        head = _unwrap(draft)
        steps = len(self.step_weights)
        valid = step_valid_masks(batch, steps)
        out = draft(
            batch.input_ids,
            self.noisy(teacher.features) if head.training else teacher.features,
            batch.attention_mask,
            steps=steps,
            logit_masks=valid,
            position_ids=batch.position_ids,
        )
        draft_index = head.t2d.long().cumsum(0) - 1  # target id -> draft id (d2t is ascending)
        greedy = teacher_greedy(teacher)
        if self.preset == EAGLE1:
            feature = teacher.features[self.capture_layers[0]]
        total = out.logits[0].new_zeros(())
        logs: dict[str, torch.Tensor] = {}
        per_anchor = self.step_weighting != "decay"  # dpace / walk: [steps, B, T] grids, weighed at the end
        losses, chances = (
            valid.new_zeros(valid.shape, dtype=torch.float32),
            valid.new_zeros(valid.shape, dtype=torch.float32),
        )
        for j, weight in enumerate(self.step_weights):
            sel = valid[j]
            t_ids = shift_left(teacher.topk_ids, 1 + j)[sel]
            t_draft = torch.where(head.t2d[t_ids], draft_index[t_ids], -1)
            t_logits = shift_left(teacher.topk_logits, 1 + j)[sel]
            ce, has_mass = soft_topk_cross_entropy(out.logits[j], t_logits, t_draft)
            logs[f"ce_{j}"] = masked_mean(ce[has_mass]).detach()
            if self.loss_name == "lk_hybrid":
                acceptance = topk_acceptance(out.logits[j], t_logits, t_draft)
                ce = torch.where(
                    has_mass, lk_hybrid(ce - teacher_entropy(t_logits, t_draft), acceptance), 0.0
                )
                logs[f"acceptance_{j}"] = masked_mean(acceptance[has_mass]).detach()
            step_loss = masked_mean(ce[has_mass])
            if self.preset == EAGLE1:
                pred = out.hidden_states[j][sel].float()
                real = shift_left(feature, 1 + j)[sel].float()
                feat_loss = masked_mean(F.smooth_l1_loss(pred, real, reduction="none").mean(-1))
                logs[f"feature_loss_{j}"] = feat_loss.detach()
                step_loss = self.feature_weight * feat_loss + self.token_weight * step_loss
            g = shift_left(greedy, 1 + j)[sel]
            draftable = head.t2d[g]
            hits = head.d2t[out.logits[j].argmax(-1)] == g
            if per_anchor:
                losses[j][sel] = torch.where(has_mass, ce, 0.0).float()
                if self.step_weighting == "walk":
                    chances[j][sel] = hits.float()
                else:  # the draft's probability of the target's token (0 where it is outside the vocabulary)
                    p = (
                        out.logits[j]
                        .detach()
                        .float()
                        .softmax(-1)
                        .gather(-1, draft_index[g].clamp_min(0)[:, None])
                    )
                    chances[j][sel] = torch.where(draftable, p[:, 0], 0.0)
            else:
                total = total + weight * step_loss
            logs[f"acc_{j}"] = masked_mean(hits[draftable].float())
            if j == 0:
                logs["oov_frac"] = masked_mean((~draftable).float())
                logs["tokens"] = sel.sum().float()
        if per_anchor:
            weights = dpace_weights(chances, valid, self.dpace_alpha)
            total = (weights * losses).sum() / max(int(valid[0].sum()), 1)
            logs.update({f"weight_{j}": masked_mean(weights[j][valid[j]]) for j in range(steps)})
        return {"loss": total, **logs}

    def noisy(self, features: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The target's features with ``feature_noise``'s uniform noise added (unchanged at 0)."""
        return feature_noise(features, self.feature_noise)

    @torch.no_grad()
    def chain_lengths(
        self, draft: nn.Module, batch: Batch, teacher: Teacher, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [B, T], starts [B, T]) for ``decoding_walk``: at each ``chain_starts`` position, the
        leading steps of a k-step TTT unroll whose argmax (as a target id)
        equals the target's greedy token there. Teacher forcing feeds the data's tokens, which equals
        chain drafting exactly where the data follows the target's greedy path (e.g. regenerated data)."""
        head = _unwrap(draft)
        starts = chain_starts(batch, k)
        accepted = torch.zeros(starts.shape, dtype=torch.long, device=starts.device)
        if k < 1 or not starts.any():
            return accepted, starts
        out = draft(
            batch.input_ids,
            teacher.features,
            batch.attention_mask,
            steps=k,
            logit_masks=starts.expand(k, *starts.shape),
            position_ids=batch.position_ids,
        )
        greedy = teacher_greedy(teacher)
        matches = torch.stack(
            [
                head.d2t[logits.argmax(-1)] == shift_left(greedy, 1 + j)[starts]
                for j, logits in enumerate(out.logits)
            ],
            dim=-1,
        )  # [N, k]
        accepted[starts] = matches.long().cumprod(-1).sum(-1)
        return accepted, starts


class Eagle1Objective(EagleObjective):
    """EAGLE-1: last-layer feature regression (smooth-L1) + soft CE over the full vocabulary."""

    def __init__(self, target, options: EagleOptions | None = None, token_counts: torch.Tensor | None = None):
        super().__init__(target, options, token_counts, preset=EAGLE1)


class Eagle3Objective(EagleObjective):
    """EAGLE-3: fused low/mid/high features, reduced draft vocabulary, TTT unroll with decaying weights."""

    def __init__(
        self, target, options: Eagle3Options | None = None, token_counts: torch.Tensor | None = None
    ):
        super().__init__(target, options, token_counts, preset=EAGLE3)


def default_exit_layer(num_layers: int) -> int:
    """Two thirds of the way up: the logit lens there already names the target's next token often, and a
    third of the target's layers is left for the draft's rollouts to overlap on a second device."""
    return max(0, -(-2 * num_layers // 3) - 1)


class MirrorObjective(EagleObjective):
    """A mirror draft: the EAGLE-3 objective on the target's early-exit layer ``early_exit_layer`` alone.

    ``kappa`` (early-exit candidates per position) and ``gamma`` (tokens per branch) are recorded as the
    draft's decoding defaults. ``early_exit_layer`` defaults to ``default_exit_layer``.
    """

    def __init__(
        self, target, options: MirrorOptions | None = None, token_counts: torch.Tensor | None = None
    ):
        o = MirrorOptions() if options is None else options
        n_layers = len(decoder_layers(target.model))
        layer = default_exit_layer(n_layers) if o.early_exit_layer is None else o.early_exit_layer
        if not -n_layers <= layer < n_layers:
            raise ValueError(
                f"draft.options.early_exit_layer {layer} is outside the target's {n_layers} decoder layers "
                f"(valid: 0..{n_layers - 1})"
            )
        (layer,) = resolve_layer_ids(target.model, [layer])
        settings = MirrorSettings(layer, o.kappa, o.gamma)
        capture = o.capture_layer_ids
        if capture is not None and resolve_layer_ids(target.model, list(capture)) != [layer]:
            raise ValueError(
                f"draft.options.capture_layer_ids {capture}: a mirror draft reads its early-exit layer alone; "
                f"drop capture_layer_ids and set early_exit_layer ({layer})"
            )
        eagle3 = {
            key: value
            for key, value in dataclasses.asdict(o).items()
            if key not in ("early_exit_layer", "kappa", "gamma")
        }
        super().__init__(
            target, Eagle3Options(**{**eagle3, "capture_layer_ids": [layer]}), token_counts, preset=EAGLE3
        )
        if (
            self.init_head is not None
            and (self.init_head.config.mirror or {}).get("early_exit_layer") != layer
        ):
            raise ValueError(
                f"draft.options.init_from: that head is not a mirror draft on layer {layer}; continue from one "
                "trained with the same early_exit_layer"
            )
        self.config.mirror = {"early_exit_layer": layer, "kappa": settings.kappa, "gamma": settings.gamma}
        setattr(self.config, DRAFT_KIND_KEY, MIRROR)


@register_objective(EAGLE1, options=EagleOptions)
def _build_eagle1(target, options: dict, token_counts=None) -> Eagle1Objective:
    return Eagle1Objective(target, EagleOptions(**options), token_counts)


@register_objective(EAGLE3, options=Eagle3Options)
def _build_eagle3(target, options: dict, token_counts=None) -> Eagle3Objective:
    return Eagle3Objective(target, Eagle3Options(**options), token_counts)


@register_objective(MIRROR, options=MirrorOptions)
def _build_mirror(target, options: dict, token_counts=None) -> MirrorObjective:
    return MirrorObjective(target, MirrorOptions(**options), token_counts)
