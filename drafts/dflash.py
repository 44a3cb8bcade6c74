"""DFlash drafts (block diffusion drafting, arXiv 2602.06036): one forward drafts a whole block.

The draft: N Qwen3-style decoder layers (per-head ``q_norm`` / ``k_norm``, SiLU MLP) at the target's
hidden size. The target's hidden states at the tapped layers are concatenated and projected, ``fc``
(K·H → H) then ``hidden_norm``; that context enters every layer only through its key / value
projections (no input norm, the layer's own ``k_norm``, RoPE at the context's positions). A block is
``[last committed token, MASK × (block_size - 1)]`` at the positions that follow the context; its
queries attend non-causally to the context and to the whole block; slot i (1..block_size-1) proposes
the token i after the last one, through ``norm`` and the target's own LM head. The token embedding and
LM head are the target's, shared, never copied (as vLLM shares them when a checkpoint has none).

Decoding keeps each layer's context keys / values as a cache: ``commit`` appends the accepted
positions' target features; a proposal runs one forward of block_size queries. Training
(``train/objectives/dflash.py``) runs many blocks of a row in one forward with ``block_attention``'s
mask: a block sees its conversation's context strictly before its anchor, and itself. The layout
follows vLLM 0.32's ``DFlashDraftModel`` (``qwen3_dflash.py``), which ``export --to vllm`` writes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, LlamaConfig, PretrainedConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.decode.features import LAYER_ID_CONVENTION, decoder_layers
from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.drafts.base import (
    DFLASH,
    DRAFT_KIND_KEY,
    DraftKind,
    Family,
    check_mask_token,
    check_target,
    default_mask_token,
    loads_strictly,
    register,
    target_layers_line,
)
from draftsmith.drafts.eagle_parts import build_vocab_map, copy_final_norm
from draftsmith.drafts.taps import check_tap_layers

MAX_BLOCK = 64
"""The largest block draftsmith trains or decodes (the paper's blocks are 8-16)."""


def block_size_refusal(block_size: int) -> str:
    return (
        f"draft.options.block_size {block_size}: a block holds the last token and at least one slot to draft, "
        f"so 2..{MAX_BLOCK} (the paper uses 8 or 16)"
    )


def default_tap_layers(num_layers: int) -> list[int]:
    """The target layers a DFlash draft reads: EAGLE-3's low / middle / high (1, L/2 - 1, L - 4), or on a
    shallow target the first, middle and second-to-last (the last is allowed, ``drafts/taps.py``, but SGLang
    and llama.cpp cannot serve it)."""
    if num_layers >= 7:
        return [1, num_layers // 2 - 1, num_layers - 4]
    return sorted({0, (num_layers - 1) // 2, max(num_layers - 2, 0)})


class DFlashConfig(PretrainedConfig):
    """Shape of a DFlash draft plus the record of the target it was trained for."""

    model_type = "draftsmith_dflash"

    def __init__(
        self,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 4,
        head_dim: int | None = None,
        num_hidden_layers: int = 1,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 4096,
        vocab_size: int = 32000,
        block_size: int = 8,
        mask_token_id: int = 0,
        draft_vocab_size: int | None = None,
        capture_layer_ids: list[int] | None = None,
        layer_id_convention: str = LAYER_ID_CONVENTION,
        target: dict | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        kwargs.pop(DRAFT_KIND_KEY, None)
        if not 2 <= int(block_size) <= MAX_BLOCK:
            raise ValueError(block_size_refusal(block_size))
        check_mask_token(mask_token_id, vocab_size)
        if int(num_hidden_layers) < 1:
            raise ValueError(f"draft.options.num_layers must be >= 1, got {num_hidden_layers}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.num_hidden_layers = int(num_hidden_layers)
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = float(rope_theta)
        self.max_position_embeddings = max_position_embeddings
        self.vocab_size = vocab_size
        self.draft_vocab_size = min(int(draft_vocab_size or vocab_size), int(vocab_size))
        """Below ``vocab_size``: the draft scores its own most frequent tokens with a head of its own (``d2t``
        maps them to the target's ids); otherwise it shares the target's LM head."""
        self.block_size = int(block_size)
        self.mask_token_id = int(mask_token_id)
        self.capture_layer_ids = list(capture_layer_ids or [0])
        self.layer_id_convention = layer_id_convention
        self.target = dict(target or {})
        self.initializer_range = initializer_range
        setattr(self, DRAFT_KIND_KEY, DFLASH)
        super().__init__(**kwargs)

    @classmethod
    def for_target(
        cls,
        target,
        num_layers: int = 1,
        block_size: int = 8,
        capture_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        draft_vocab_size: int | None = None,
    ) -> DFlashConfig:
        """A config whose dimensions, rotary base and taps come from ``target`` (a decode Target)."""
        tcfg = target.config
        n_layers = len(decoder_layers(target.model))
        ids = check_tap_layers(
            default_tap_layers(n_layers) if capture_layer_ids is None else list(capture_layer_ids), n_layers
        )
        max_positions = getattr(tcfg, "max_position_embeddings", 4096)
        if block_size > max_positions:
            raise ValueError(
                f"draft.options.block_size {block_size} is longer than the target's {max_positions} positions"
            )
        rope = getattr(tcfg, "rope_parameters", None) or {}
        vocab = target.vocab_size
        return cls(
            hidden_size=tcfg.hidden_size,
            intermediate_size=tcfg.intermediate_size,
            num_attention_heads=tcfg.num_attention_heads,
            num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads,
            head_dim=getattr(tcfg, "head_dim", None),
            num_hidden_layers=num_layers,
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(tcfg, "rope_theta", 10000.0))),
            max_position_embeddings=max_positions,
            vocab_size=vocab,
            draft_vocab_size=draft_vocab_size,
            block_size=block_size,
            mask_token_id=default_mask_token(target.tokenizer, vocab)
            if mask_token_id is None
            else mask_token_id,
            capture_layer_ids=ids,
            target=target.record(),
        )

    def rope_config(self) -> LlamaConfig:
        """The config the stock rotary embedding is built from (RoPE in the rotate-half layout vLLM uses)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
        )


AutoConfig.register(DFlashConfig.model_type, DFlashConfig, exist_ok=True)

KV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values [B, kv_heads, S, head_dim] (keys normed and rotated)."""


class DFlashAttention(nn.Module):
    """Self-attention of a block over the context's keys / values and its own, non-causal."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        H, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, H, bias=False)
        self.q_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> KV:
        """x [B, S, H] → keys [B, kv, S, d] (k_norm, then RoPE) and values [B, kv, S, d]."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, S, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        context: KV,
        context_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Blocks x [B, N, Q, H] (N blocks of Q slots each, ``rope`` at their positions, [B, N·Q, d]) over
        ``context`` (keys / values [B, kv, C, d]) where ``context_mask`` [B, N, C] allows, and over every
        slot of their own block. Returns [B, N, Q, H]."""
        B, N, Q, H = x.shape
        flat = x.reshape(B, N * Q, H)
        q = self.q_norm(self.q_proj(flat).view(B, N * Q, self.heads, self.head_dim)).transpose(1, 2)
        cos, sin = rope
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k_block, v_block = self.keys_values(flat, rope)
        C = context[0].shape[2]
        keys, values = torch.cat([context[0], k_block], 2), torch.cat([context[1], v_block], 2)
        own = torch.eye(N, dtype=torch.bool, device=x.device).repeat_interleave(Q, 0).repeat_interleave(Q, 1)
        sees_context = context_mask[:, :, None, :].expand(B, N, Q, C).reshape(B, N * Q, C)
        mask = torch.cat([sees_context, own.expand(B, -1, -1)], -1)[:, None]  # [B, 1, N·Q, C + N·Q]
        # one dense attention call: faster on CPU than scoring context and blocks apart (bench/dflash_attention.py)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        out = out.view(B, self.heads, N, Q, self.head_dim)
        out = out.permute(0, 2, 3, 1, 4).reshape(B, N, Q, self.heads * self.head_dim)
        return self.o_proj(out)


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    """A pre-norm decoder layer whose attention also reads the context (``DFlashAttention``)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h, rope, context: KV, context_mask) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, context, context_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(PreTrainedModel):
    """The DFlash draft's own weights; the token embedding and LM head are the target's, passed in."""

    config_class = DFlashConfig
    base_model_prefix = DFLASH

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        H = config.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.capture_layer_ids) * H, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config.rope_config())
        if self.has_own_head:
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            d2t, t2d = build_vocab_map(torch.zeros(config.vocab_size), config.draft_vocab_size)
            self.register_buffer("d2t", d2t)
            self.register_buffer("t2d", t2d)
        self.post_init()

    @property
    def has_own_head(self) -> bool:
        """Whether the draft scores a reduced vocabulary with a head of its own (else the target's LM head)."""
        return self.config.draft_vocab_size < self.config.vocab_size

    @torch.no_grad()
    def init_from_target(self, model: nn.Module, token_counts: torch.Tensor | None = None) -> None:
        """Start the output norm as the target's final norm where an RMSNorm reproduces it (else ones); a
        reduced vocabulary keeps the ``token_counts`` most frequent ids, its head their rows of the target's."""
        copy_final_norm(model, self.norm)
        if self.has_own_head:
            if token_counts is None or token_counts.numel() != self.config.vocab_size:
                raise ValueError(
                    f"a DFlash draft vocabulary of {self.config.draft_vocab_size} < {self.config.vocab_size} needs "
                    "token_counts over the target's vocabulary; or set draft_vocab_size to the target's"
                )
            d2t, t2d = build_vocab_map(token_counts, self.config.draft_vocab_size)
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
            self.lm_head.weight.copy_(model.get_output_embeddings().weight[d2t].to(self.lm_head.weight.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids as the target's."""
        return self.d2t[draft_ids] if self.has_own_head else draft_ids

    def _rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(like, positions)

    def context(self, features: dict[int, torch.Tensor], positions: torch.Tensor) -> list[KV]:
        """Target features {layer_id: [B, C, H]} at ``positions`` [B, C] → every layer's context keys / values."""
        missing = [i for i in self.config.capture_layer_ids if i not in features]
        if missing:
            raise ValueError(
                f"the DFlash draft reads target layers {self.config.capture_layer_ids}; missing {missing}"
            )
        dtype = self.fc.weight.dtype
        x = self.hidden_norm(
            self.fc(torch.cat([features[i].to(dtype) for i in self.config.capture_layer_ids], -1))
        )
        rope = self._rope(x, positions)
        return [layer.self_attn.keys_values(x, rope) for layer in self.layers]

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        context_mask: torch.Tensor,
        context: list[KV] | None = None,
        features: dict[int, torch.Tensor] | None = None,
        feature_positions: torch.Tensor | None = None,
        target_head: nn.Module | None = None,
    ) -> torch.Tensor:
        """Blocks' input embeddings [B, N, Q, H] at ``positions`` [B, N, Q] over a context — cached keys / values
        (``context()``), or target ``features`` at ``feature_positions`` [B, C] (training: through forward, so
        DDP / FSDP see every parameter) — where ``context_mask`` [B, N, C] allows → normed hidden states
        [B, N, Q, H]; or, with the target's LM head (``target_head``) or a head of its own, the logits of slots
        1..Q-1 over the draft vocabulary [B, N, Q - 1, Vd] (inside forward, for DDP / FSDP)."""
        if context is None:
            context = self.context(features, feature_positions)
        B, N, Q, _ = embeds.shape
        h = embeds.to(self.fc.weight.dtype)
        rope = self._rope(h, positions.reshape(B, N * Q))
        for layer, kv in zip(self.layers, context):
            h = layer(h, rope, kv, context_mask)
        h = self.norm(h)
        head = self.lm_head if self.has_own_head else target_head
        if head is None:
            return h
        return head(h[:, :, 1:].to(head.weight.dtype))


def block_inputs(
    anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks from anchors [B, N]: token ids [B, N, Q] ``[anchor, MASK × (Q - 1)]`` and their positions."""
    ids = torch.full(
        (*anchor_tokens.shape, block_size), mask_token_id, dtype=torch.long, device=anchor_tokens.device
    )
    ids[..., 0] = anchor_tokens
    offsets = torch.arange(block_size, device=anchor_positions.device)
    return ids, anchor_positions[..., None] + offsets


class DFlashDrafter(Drafter):
    """Drafts a block per proposal: one forward of the draft over its cached context and a new block."""

    def __init__(self, draft: DFlashDraft, target_model: nn.Module, name: str = DFLASH):
        self.draft = draft
        self.name = name
        self.capture_layers = tuple(draft.config.capture_layer_ids)
        self.embed_weight = target_model.get_input_embeddings().weight
        self.lm_head = target_model.get_output_embeddings()
        self.context: list[KV] = []
        self.length = 0  # positions held in the context cache

    def _extend(self, features: dict[int, torch.Tensor] | None) -> None:
        if not features or any(i not in features for i in self.capture_layers):
            raise ValueError(
                f"the DFlash drafter needs the target's features of layers {list(self.capture_layers)} at begin and "
                "every commit; set target.set_capture(drafter.capture_layers) before the prefill"
            )
        n = features[self.capture_layers[0]].shape[0]
        positions = torch.arange(self.length, self.length + n, device=self.embed_weight.device)[None]
        new = self.draft.context({i: features[i][None] for i in self.capture_layers}, positions)
        self.context = (
            new
            if not self.context
            else [
                (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                for (k, v), (nk, nv) in zip(self.context, new)
            ]
        )
        self.length += n

    @torch.inference_mode()
    def begin(self, prompt: torch.Tensor, features: dict[int, torch.Tensor] | None) -> None:
        self.context, self.length = [], 0
        self._extend(features)

    def block_logits(self, last_token: int, position: int) -> torch.Tensor:
        """Logits [Q - 1, Vd] (the draft vocabulary) of the block after ``last_token`` at ``position`` (context: positions before it)."""
        cfg = self.draft.config
        device = self.embed_weight.device
        ids, positions = block_inputs(
            torch.tensor([[last_token]], device=device), torch.tensor([[position]], device=device),
            cfg.block_size, cfg.mask_token_id,
        )  # fmt: skip
        mask = torch.ones(1, 1, self.length, dtype=torch.bool, device=device)
        logits = self.draft(F.embedding(ids, self.embed_weight), positions, mask, context=self.context,
                            target_head=self.lm_head)  # fmt: skip
        return logits[0, 0].float()

    @torch.inference_mode()
    def propose(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> Proposal:
        n = min(k, self.draft.config.block_size - 1)
        if n <= 0:
            return Proposal(tokens.new_empty(0))
        if self.length != tokens.shape[0] - 1:
            raise RuntimeError(
                f"DFlash context holds {self.length} positions but {tokens.shape[0]} tokens are committed: the "
                "decoder must commit every verify step's features"
            )
        logits = self.block_logits(int(tokens[-1]), self.length)[:n]
        drafted, probs = self.choose(logits, int(tokens[-1]), sampling, generator)
        if probs is not None and self.draft.has_own_head:  # over the target's vocabulary, for the verify rule
            probs = probs.new_zeros(n, self.draft.config.vocab_size).index_copy_(1, self.draft.d2t, probs)
        return Proposal(drafted.to(tokens.device), probs)

    def choose(
        self, logits: torch.Tensor, last_token: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's drafts (target ids) from its slots' logits [n, Vd], and under sampling the draft-vocabulary
        distributions they were drawn from (None when greedy): every slot at once."""
        if sampling.greedy:
            return self.draft.to_target_ids(logits.argmax(-1)), None
        probs = to_probs(logits, sampling)
        return self.draft.to_target_ids(sample(probs, generator)), probs

    @torch.inference_mode()
    def commit(self, num_accepted: int, features: dict[int, torch.Tensor] | None) -> None:
        self._extend(features)


def load_draft(target, path: str, model_class: type[DFlashDraft] = DFlashDraft, what: str = "DFlash draft"):
    """A saved draft of ``model_class`` (DFlash's or a kind built on it) on the target's device and dtype,
    frozen, after checking it was made for ``target``."""
    if not path or not (Path(path) / "config.json").is_file():
        raise ValueError(f"a {what} needs a checkpoint directory saved by `draftsmith train` (got {path!r})")
    draft = (
        model_class.from_pretrained(path, dtype=target.dtype).to(target.device).eval().requires_grad_(False)
    )
    check_target(draft.config.target, target, what, draft.config.layer_id_convention)
    return draft


def _build(target, path: str) -> Drafter:
    return DFlashDrafter(load_draft(target, path), target.model, name=f"{DFLASH}:{Path(path).name}")


def card_lines(config: dict) -> list[str]:
    vocab, full = config.get("draft_vocab_size") or config.get("vocab_size"), config.get("vocab_size")
    scores = (
        "the target's vocabulary, with its LM head" if vocab == full else f"its own {vocab}-token vocabulary"
    )
    return [
        target_layers_line(config),
        f"- {config.get('num_hidden_layers')} decoder layer(s); one forward drafts the "
        f"{int(config.get('block_size', 2)) - 1} tokens after the last one (block size {config.get('block_size')}, "
        f"mask token {config.get('mask_token_id')}); scores {scores}",
    ]


DFLASH_BLOCKS = Family(DFLASH, "DFlash draft", verify_hf=loads_strictly(DFlashDraft), card_lines=card_lines)
"""Block drafters on the target's tapped hidden states (the family's name is the kind's)."""
register(DraftKind(DFLASH, "DFlash draft", _build, DFLASH_BLOCKS))  # every engine with a DFlash writer
