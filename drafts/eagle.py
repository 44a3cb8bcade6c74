"""EAGLE draft heads: a small decoder that reads the target's hidden states and predicts the next tokens.

Two presets share one ``EagleHead``:

- ``eagle1`` (EAGLE-1): input at position t is ``Linear(2H→H)([emb(x_{t+1}), f_t])`` with f the target's
  last-layer output (pre final norm); N stock Llama decoder layers; the target's frozen final norm and
  LM head give the logits. The output h_t regresses f_{t+1} and is fed back as the next feature.
- ``eagle3`` (EAGLE-3): three target layers (low, mid, high) are concatenated and fused by
  ``Linear(3H→H)``; the first decoder layer's attention reads ``[norm_e(emb), norm_f(feature)]`` (2H),
  its residual stream is the feature; its own final norm and LM head score a reduced draft vocabulary
  whose ids map to the target's through ``d2t``. The layer output stands in for the fused feature at
  the next step.

Training unrolls the head several steps on its own outputs ("training-time test", TTT): at step j the
query at anchor t attends causally to step-0 keys (real features) and to its own keys of steps 1..j at
the same anchor — exactly what chain drafting sees at inference. ``ttt_attention_mask`` builds that mask;
it and the head's other stand-alone parts, which training imports too, are in ``eagle_parts.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, DynamicCache, LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from draftsmith.decode.drafter import Drafter
from draftsmith.decode.features import LAYER_ID_CONVENTION, decoder_layers
from draftsmith.drafts.base import (
    DRAFT_KIND_KEY,
    EAGLE1,
    EAGLE3,
    MIRROR,
    PEAGLE,
    DraftKind,
    Family,
    kind_of_checkpoint,
    register,
    strict_load,
    target_layers_line,
)
from draftsmith.drafts.base import check_target as check_draft_target
from draftsmith.drafts.eagle_drafter import EagleDrafter
from draftsmith.drafts.eagle_parts import (
    WideInputLayer,
    build_vocab_map,
    check_vocab_maps,
    copy_final_norm,
    packed_segments,
    parallel_attention_mask,
    ttt_attention_mask,
)
from draftsmith.drafts.engines import HF
from draftsmith.drafts.taps import check_tap_layers

PRESETS = (EAGLE1, EAGLE3)


def default_eagle3_layers(num_layers: int) -> list[int]:
    """Low, middle and high layer ids (0-based outputs) as EAGLE-3 picks them: 1, L/2 - 1, L - 4."""
    if num_layers < 7:  # too shallow for the 1 / L/2-1 / L-4 spread: first, middle, last
        return sorted({0, (num_layers - 1) // 2, num_layers - 1})
    return [1, num_layers // 2 - 1, num_layers - 4]


class EagleConfig(PretrainedConfig):
    """Shape of an EAGLE head plus the record of the target it was trained for."""

    model_type = "draftsmith_eagle"

    def __init__(
        self,
        preset: str = EAGLE3,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 4,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 4096,
        vocab_size: int = 32000,
        draft_vocab_size: int | None = None,
        num_decoder_layers: int = 1,
        capture_layer_ids: list[int] | None = None,
        layer_id_convention: str = LAYER_ID_CONVENTION,
        ttt_steps: int = 1,
        lm_head_is_embedding: bool = False,
        logit_softcap: float | None = None,
        target: dict | None = None,
        initializer_range: float = 0.02,
        mirror: dict | None = None,
        norm_before_residual: bool = False,
        norm_before_fc: bool = False,
        norm_output: bool = False,
        feature_input_norm: bool = False,
        mask_token_id: int | None = None,
        parallel_depths: int | None = None,
        **kwargs,
    ):
        kwargs.pop(DRAFT_KIND_KEY, None)
        if preset not in PRESETS:
            raise ValueError(f"unknown EAGLE preset {preset!r}; choose one of {', '.join(PRESETS)}")
        self.preset = preset
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.vocab_size = vocab_size
        self.draft_vocab_size = (
            min(draft_vocab_size or vocab_size, vocab_size) if preset == EAGLE3 else vocab_size
        )
        self.num_decoder_layers = num_decoder_layers
        self.capture_layer_ids = list(capture_layer_ids or [])
        self.layer_id_convention = layer_id_convention
        self.ttt_steps = ttt_steps
        self.lm_head_is_embedding = lm_head_is_embedding
        self.logit_softcap = logit_softcap
        self.target = dict(target or {})
        self.initializer_range = initializer_range
        self.mirror = dict(mirror) if mirror else None
        """A mirror draft's early_exit_layer, kappa and gamma (``drafts/mirror.py``); None otherwise."""
        # the EAGLE-3.1 norms (draft.options of an eagle3 recipe) and a variant only imported heads have
        # (drafts/eagle_import.py reads the peers' heads with any of them):
        self.norm_before_residual = norm_before_residual  # the first layer's residual is hidden_norm(feature)
        self.norm_before_fc = norm_before_fc  # one RMSNorm over the concatenated target states before fc
        self.norm_output = norm_output  # the hidden state fed back is the final norm's output
        self.feature_input_norm = feature_input_norm  # imported only: input_layernorm, then hidden_norm
        self.mask_token_id = None if mask_token_id is None else int(mask_token_id)
        """P-EAGLE (``drafts/peagle.py``): the token embedded at the slots drafted in parallel; None: a chain head."""
        self.parallel_depths = None if parallel_depths is None else int(parallel_depths)
        """P-EAGLE: the tokens one forward was trained to draft (the real pair and parallel_depths - 1 slots)."""
        if self.mask_token_id is not None and preset != EAGLE3:
            raise ValueError("parallel drafting (mask_token_id) is a variant of EAGLE-3 heads only")
        # the kind's name (earlier versions wrote "eagle"); mirror and P-EAGLE drafts are EAGLE-3 heads underneath
        setattr(self, DRAFT_KIND_KEY, MIRROR if self.mirror else PEAGLE if self.parallel else preset)
        super().__init__(**kwargs)

    @property
    def own_draft_vocab(self) -> bool:
        """Whether the head has an LM head of its own over a draft vocabulary (EAGLE-3's), which can shrink."""
        return self.preset == EAGLE3 and not self.lm_head_is_embedding

    @property
    def parallel(self) -> bool:
        """Whether the head drafts all its tokens in one forward (P-EAGLE) rather than one per forward."""
        return self.mask_token_id is not None

    @classmethod
    def for_target(
        cls,
        target,
        preset: str = EAGLE3,
        num_decoder_layers: int = 1,
        capture_layer_ids: list[int] | None = None,
        draft_vocab_size: int = 32000,
        ttt_steps: int = 1,
    ) -> EagleConfig:
        """A config whose dimensions, rotary base and capture layers come from ``target`` (a decode Target)."""
        tcfg = target.config
        n_layers = tcfg.num_hidden_layers
        if capture_layer_ids is None:
            capture_layer_ids = [n_layers - 1] if preset == EAGLE1 else default_eagle3_layers(n_layers)
        ids = check_tap_layers(list(capture_layer_ids), len(decoder_layers(target.model)))
        if preset == EAGLE1 and len(ids) != 1:
            raise ValueError(f"EAGLE-1 reads exactly one target layer (the last, {n_layers - 1}); got {ids}")
        rope = getattr(tcfg, "rope_parameters", None) or {}
        model = target.model
        return cls(
            preset=preset,
            hidden_size=tcfg.hidden_size,
            intermediate_size=tcfg.intermediate_size,
            num_attention_heads=tcfg.num_attention_heads,
            num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads,
            head_dim=getattr(tcfg, "head_dim", None),
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(tcfg, "rope_theta", 10000.0))),
            max_position_embeddings=getattr(tcfg, "max_position_embeddings", 4096),
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            num_decoder_layers=num_decoder_layers,
            capture_layer_ids=ids,
            ttt_steps=ttt_steps,
            lm_head_is_embedding=preset == EAGLE1
            and model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            logit_softcap=getattr(tcfg, "final_logit_softcapping", None) if preset == EAGLE1 else None,
            target=target.record(),
        )

    def decoder_config(self) -> LlamaConfig:
        """The Llama config the stock decoder layers and rotary embedding are built from."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
            num_hidden_layers=self.num_decoder_layers,
            vocab_size=self.vocab_size,
            attn_implementation="sdpa",
        )


AutoConfig.register(EagleConfig.model_type, EagleConfig, exist_ok=True)


def check_target(config: EagleConfig, target) -> None:
    """Refuse to use a head with a target other than the one it was trained for."""
    check_draft_target(config.target, target, f"EAGLE head ({config.preset})", config.layer_id_convention)


@dataclass
class EagleOutput:
    """One tensor per unroll step: hidden states [B, T, H]; logits [B, T, Vd], or [N_j, Vd] when selected."""

    hidden_states: list[torch.Tensor]
    logits: list[torch.Tensor]


class EagleHead(PreTrainedModel):
    """The EAGLE draft head (both presets). Frozen copies of the target's weights it needs are stored in it."""

    config_class = EagleConfig
    base_model_prefix = "eagle"
    _supports_sdpa = True

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        cfg = config.decoder_config()
        H, V = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        if config.preset == EAGLE3:
            if config.norm_before_fc:
                self.fuse_norm = LlamaRMSNorm(len(config.capture_layer_ids) * H, eps=config.rms_norm_eps)
            self.fuse_features = nn.Linear(len(config.capture_layer_ids) * H, H, bias=False)
            first: list[nn.Module] = [
                WideInputLayer(cfg, 0, config.norm_before_residual, config.feature_input_norm)
            ]
            self.layers = nn.ModuleList(
                first + [LlamaDecoderLayer(cfg, i) for i in range(1, config.num_decoder_layers)]
            )
        else:
            self.input_proj = nn.Linear(2 * H, H, bias=True)
            self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(config.num_decoder_layers)])
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        if not config.lm_head_is_embedding:
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        d2t, t2d = build_vocab_map(torch.zeros(V), config.draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        if config.parallel:  # P-EAGLE: the target features standing in at slots drafted in parallel
            self.mask_hidden = nn.Parameter(torch.zeros(len(config.capture_layer_ids) * H))
        self.freeze_target_copies()
        self.post_init()

    def freeze_target_copies(self) -> EagleHead:
        """Mark the copies of the target's weights as not trainable: the token embedding, and for EAGLE-1
        the final norm and LM head. ``from_pretrained`` loads fresh parameters, which are trainable
        again, so a head loaded to train further calls this once more."""
        self.embed_tokens.requires_grad_(False)
        if self.config.preset == EAGLE1:
            self.norm.requires_grad_(False)
            if not self.config.lm_head_is_embedding:
                self.lm_head.requires_grad_(False)
        return self

    # -- set-up from the target ------------------------------------------------------------------

    @torch.no_grad()
    def init_from_target(self, model: nn.Module) -> bool:
        """Start from the target's own output side: copy its token embeddings, final norm and LM head;
        returns whether the LM head is the target's (False: EAGLE-3's fresh one, see below).

        EAGLE-1 reuses them frozen. EAGLE-3 starts its own norm and LM head from the target's (the LM
        head's rows at ``d2t``, so install the vocab map first): the head then begins as "whatever
        hidden state it produces is read out like the target's", which trains much faster than a
        random readout. A target whose final norm cannot be reproduced keeps EAGLE-3's fresh norm.
        """
        self.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        copied_norm = copy_final_norm(model, self.norm)
        if self.config.preset == EAGLE1:
            if not copied_norm:
                raise ValueError(
                    f"EAGLE-1 reuses the target's final norm, but {type(model).__name__}'s is not an RMSNorm "
                    "this head can reproduce; use preset eagle3, which has its own norm and LM head"
                )
            if not self.config.lm_head_is_embedding:
                self.lm_head.weight.copy_(model.get_output_embeddings().weight)
        elif copied_norm:
            self.lm_head.weight.copy_(model.get_output_embeddings().weight[self.d2t])
        if self.config.parallel:  # unit-scale, as the peers start it; zeros would sit at hidden_norm's pole
            self.mask_hidden.normal_()
        return copied_norm

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft→target id map from ``build_vocab_map`` (EAGLE-3)."""
        if d2t.numel() != self.config.draft_vocab_size or t2d.numel() != self.config.vocab_size:
            raise ValueError(
                f"vocab map sizes {d2t.numel()}/{t2d.numel()} do not match draft_vocab_size "
                f"{self.config.draft_vocab_size} / vocab_size {self.config.vocab_size}"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    # -- the pieces drafting and training share ---------------------------------------------------

    def fuse(self, features: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target features {layer_id: [..., H]} → the head's step-0 input feature [..., H]."""
        missing = [i for i in self.config.capture_layer_ids if i not in features]
        if missing:
            raise ValueError(
                f"EAGLE head needs target layers {self.config.capture_layer_ids}; missing {missing}"
            )
        dtype = self.embed_tokens.weight.dtype
        x = torch.cat([features[i].to(dtype) for i in self.config.capture_layer_ids], dim=-1)
        if self.config.preset != EAGLE3:
            return x
        return self.fuse_concatenated(x)

    def fuse_concatenated(self, x: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's fusion of target states already concatenated in ``capture_layer_ids`` order [..., n·H]."""
        return self.fuse_features(self.fuse_norm(x) if self.config.norm_before_fc else x)

    def mask_feature(self) -> torch.Tensor:
        """P-EAGLE: the fused feature [H] of a slot drafted in parallel (``mask_hidden`` through the fusion)."""
        return self.fuse_concatenated(self.mask_hidden.to(self.fuse_features.weight.dtype))

    def step(
        self,
        feature: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: DynamicCache | None,
    ) -> torch.Tensor:
        """One pass over pairs (feature_t [B,S,H], token_{t+1} [B,S]) → hidden states [B,S,H].

        ``attention_mask``: bool [B,1,S,S_total] (True = attend), needed whenever S > 1.
        """
        emb = self.embed_tokens(input_ids)
        pos = self.rotary_emb(feature, position_ids)
        layers = list(self.layers)
        if self.config.preset == EAGLE3:
            h = layers.pop(0)(emb, feature, pos, attention_mask, cache)
        else:
            h = self.input_proj(torch.cat([emb, feature.to(emb.dtype)], dim=-1))
        for layer in layers:
            h = layer(h, attention_mask=attention_mask, position_embeddings=pos, cache=cache)
        return self.norm(h) if self.config.norm_output else h

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., H] → logits over the draft vocabulary [..., Vd]."""
        normed = hidden if self.config.norm_output else self.norm(hidden)  # norm_output: step normed it
        if self.config.lm_head_is_embedding:
            logits = F.linear(normed, self.embed_tokens.weight)
        else:  # a module call, so decoding's packed CPU kernels (decode/cpu_kernels.py) apply to it
            logits = self.lm_head(normed)
        if self.config.logit_softcap:
            logits = torch.tanh(logits / self.config.logit_softcap) * self.config.logit_softcap
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,
        features: dict[int, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        steps: int = 1,
        logit_masks: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> EagleOutput:
        """Unroll ``steps`` TTT steps over a batch (anchor t: feature_t with token_{t+1+j} at step j).

        input_ids [B,T]; features {layer_id: [B,T,H]}; attention_mask [B,T] (1 = real token);
        logit_masks [steps,B,T] bool: compute logits only there (saves the LM head on masked positions);
        position_ids [B,T]: packed rows (positions restart at each conversation) — a query then sees
        only step-0 keys of its own conversation (block-diagonal), as if each were its own row.
        ``slots`` (P-EAGLE): (anchors, depths, keep) [B, S] — one forward over the real pairs and S slots
        drafted in parallel (``parallel_attention_mask``); logit_masks is then [1, B, T + S].
        """
        B, T = input_ids.shape
        device = input_ids.device
        real = (
            torch.ones(B, T, dtype=torch.bool, device=device)
            if attention_mask is None
            else attention_mask.bool()
        )
        if position_ids is None:
            positions = (real.long().cumsum(-1) - 1).clamp_min(0)
            segments = same_row = None
        else:
            positions = position_ids.to(device)
            segments = packed_segments(positions)
            same_row = segments[:, :, None] == segments[:, None, :]  # [B, T, T]
        if slots is not None:
            segments = torch.zeros_like(positions) if segments is None else segments
            return self._parallel(input_ids, features, real, positions, segments, slots, logit_masks)
        eye = torch.eye(T, dtype=torch.bool, device=device)
        cache = DynamicCache()
        hidden, all_hidden, all_logits = self.fuse(features), [], []
        for j in range(steps):
            ids = F.pad(input_ids[:, 1 + j :], (0, 1 + j))  # token_{t+1+j}, zero past the end (never counted)
            keys_ok = torch.cat([real] + [torch.ones_like(real)] * j, dim=1)  # padded step-0 keys are hidden
            mask = ttt_attention_mask(T, j, device)[None] & keys_ok[:, None, :]
            if same_row is not None:
                mask[:, :, :T] &= same_row
            mask[:, :, :T] |= eye  # ...except a query's own anchor, so no row is empty
            hidden = self.step(hidden, ids, positions + j, mask[:, None], cache)
            all_hidden.append(hidden)
            selected = hidden if logit_masks is None else hidden[logit_masks[j]]
            all_logits.append(self.draft_logits(selected))
        return EagleOutput(all_hidden, all_logits)

    def _parallel(self, input_ids, features, real, positions, segments, slots, logit_masks) -> EagleOutput:
        """One forward over the real pairs (feature_t, token_{t+1}) and the P-EAGLE slots ``(fuse(mask_hidden),
        MASK)`` at position anchor + depth (see ``forward``)."""
        anchors, depths, keep = slots
        ids = torch.cat(
            [F.pad(input_ids[:, 1:], (0, 1)), torch.full_like(anchors, self.config.mask_token_id)], 1
        )
        fused = self.fuse(features)
        feature = torch.cat([fused, self.mask_feature().to(fused.dtype).expand(*anchors.shape, -1)], dim=1)
        slot_positions = positions.gather(1, anchors) + depths
        mask = parallel_attention_mask(real, segments, anchors, depths, keep)
        hidden = self.step(feature, ids, torch.cat([positions, slot_positions], 1), mask[:, None], None)
        selected = hidden if logit_masks is None else hidden[logit_masks[0]]
        return EagleOutput([hidden], [self.draft_logits(selected)])


def load_head(target, path: str, what: str = "an EAGLE draft") -> EagleHead:
    """A saved head on the target's device and dtype, frozen, after checking it was trained for ``target``."""
    if not path or not (Path(path) / "config.json").is_file():
        raise ValueError(f"{what} needs a checkpoint directory saved by `draftsmith train` (got {path!r})")
    head = EagleHead.from_pretrained(path, dtype=target.dtype).to(target.device).eval().requires_grad_(False)
    check_target(head.config, target)
    return head


def is_eagle3(config: dict) -> bool:
    """Whether a saved EAGLE head's config.json is an EAGLE-3 head (the layout engines load), not EAGLE-1."""
    return config.get("preset") == EAGLE3


def load_vocab_head(folder: Path) -> EagleHead:
    """A head folder ``draftsmith train`` saved whose draft vocabulary can shrink (EAGLE-3, P-EAGLE), in float32;
    any other kind refused, naming it."""
    kind = kind_of_checkpoint(folder)
    if kind.name not in (EAGLE3, PEAGLE):
        raise ValueError(f"{folder} is a {kind.title} ({kind.name}); only EAGLE-3 and P-EAGLE heads have a draft "
                         "vocabulary of their own to shrink")  # fmt: skip
    return EagleHead.from_pretrained(folder, dtype=torch.float32)


def _build(target, path: str) -> Drafter:
    head = load_head(target, path)
    return EagleDrafter(head, name=f"{getattr(head.config, DRAFT_KIND_KEY)}:{Path(path).name}")


def verify_saved(folder: Path) -> list[str]:
    """Problems an EAGLE head folder for transformers has: strict from_pretrained, layer ids, vocab maps."""
    head, problems = strict_load(EagleHead, folder)
    cfg = head.config
    n_layers = (cfg.target or {}).get("num_hidden_layers")
    if n_layers is None:
        problems.append("config.target records no target layer count")
    elif any(not 0 <= i < n_layers for i in cfg.capture_layer_ids):
        problems.append(f"capture_layer_ids {cfg.capture_layer_ids} outside 0..{n_layers - 1}")
    if cfg.preset == EAGLE3:
        check_vocab_maps(head.d2t, head.t2d, cfg.vocab_size, False, problems)
    return problems


def card_lines(config: dict) -> list[str]:
    return [
        target_layers_line(config),
        f"- draft vocabulary: {config.get('draft_vocab_size')} of the target's {config.get('vocab_size')} tokens "
        "(`d2t`: absolute target ids, ascending; `t2d`: mask over the target vocabulary)",
    ]


EAGLE = Family("eagle", "EAGLE head", verify_hf=verify_saved, card_lines=card_lines)
"""A head on the target's hidden states, saved as ``EagleHead`` (EAGLE-1, EAGLE-3, mirror, imported heads)."""
register(DraftKind(EAGLE3, "EAGLE-3 head", _build, EAGLE))  # every engine with an EAGLE-3 layout
register(DraftKind(EAGLE1, "EAGLE-1 head", _build, EAGLE, exports=(HF,), refusal=(
    "draftsmith's EAGLE-1 head keeps its first layer's input norm and applies the target's final norm before its "
    "LM head; vLLM 0.32's EAGLE-1 model (llama_eagle.py) replaces layer 0's input norm by the identity and reads "
    "logits from hidden + residual with no norm (the other engines were not checked for EAGLE-1); train an "
    "eagle3 head, or use this one with `draftsmith eval`")))  # fmt: skip
