"""Medusa heads: N small heads on the target's last hidden state, head i guessing the token i+2 ahead.

Input. The target's last decoder layer, captured with the convention of ``decode/features.py``
(layer id ``L - 1``: output of the last decoder layer, *before* the final norm), passed through a
frozen copy of the target's final norm — i.e. exactly the hidden state the target's LM head reads.
At position t that state gives the target's token t+1; head i (0-based) predicts token t+2+i.

Head i: ``num_layers`` residual blocks ``x + SiLU(W x + b)`` then an LM head. The blocks start at
zero and the LM heads as copies of the target's, so an untrained head i proposes the target's own
next token (a weak but valid guess). ``shared_lm_head`` uses one frozen copy for all heads (only
the blocks train: far fewer parameters for large vocabularies).

Drafting: the feature at the last accepted position yields all k drafts in one shot (no chain of
draft forwards): greedy takes each head's argmax; sampling draws from each head's distribution and
returns those distributions, so verification stays lossless. Trees (``propose_tree``): each level
holds head d's top-k tokens under the best nodes of the level above (``decode/tree.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.decode.features import LAYER_ID_CONVENTION
from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.decode.tree import DraftTree, TreeBuilder, TreeSpec
from draftsmith.drafts.base import (
    DRAFT_KIND_KEY,
    MEDUSA,
    DraftKind,
    Family,
    check_target,
    loads_strictly,
    register,
    target_layers_line,
)
from draftsmith.drafts.eagle_parts import copy_final_norm
from draftsmith.drafts.engines import HF, VLLM


class MedusaConfig(PretrainedConfig):
    """Shape of the Medusa heads plus the record of the target they were trained for."""

    model_type = "draftsmith_medusa"

    def __init__(
        self,
        hidden_size: int = 64,
        vocab_size: int = 32000,
        num_heads: int = 4,
        num_layers: int = 1,
        shared_lm_head: bool = False,
        rms_norm_eps: float = 1e-6,
        logit_softcap: float | None = None,
        capture_layer_ids: list[int] | None = None,
        layer_id_convention: str = LAYER_ID_CONVENTION,
        target: dict | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        kwargs.pop(DRAFT_KIND_KEY, None)
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.shared_lm_head = shared_lm_head
        self.rms_norm_eps = rms_norm_eps
        self.logit_softcap = logit_softcap
        self.capture_layer_ids = list(capture_layer_ids or [])
        self.layer_id_convention = layer_id_convention
        self.target = dict(target or {})
        self.initializer_range = initializer_range
        setattr(self, DRAFT_KIND_KEY, MEDUSA)
        super().__init__(**kwargs)

    @classmethod
    def for_target(
        cls, target, num_heads: int = 4, num_layers: int = 1, shared_lm_head: bool = False
    ) -> MedusaConfig:
        """A config sized for ``target`` (a decode Target), reading its last decoder layer."""
        tcfg = target.config
        return cls(
            hidden_size=tcfg.hidden_size,
            vocab_size=target.vocab_size,
            num_heads=num_heads,
            num_layers=num_layers,
            shared_lm_head=shared_lm_head,
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
            logit_softcap=getattr(tcfg, "final_logit_softcapping", None),
            capture_layer_ids=[tcfg.num_hidden_layers - 1],
            target=target.record(),
        )


AutoConfig.register(MedusaConfig.model_type, MedusaConfig, exist_ok=True)


class ResBlock(nn.Module):
    """``x + SiLU(Linear(x))``; zero-initialised by ``MedusaHeads.init_from_target`` (identity at start)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(PreTrainedModel):
    """The Medusa heads. Frozen copies of the target's final norm (and, if shared, LM head) live in it."""

    config_class = MedusaConfig
    base_model_prefix = "medusa"

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        H, V = config.hidden_size, config.vocab_size
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps).requires_grad_(False)
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(H) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        if config.shared_lm_head:
            self.lm_head = nn.Linear(H, V, bias=False).requires_grad_(False)
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(config.num_heads))
        self.post_init()

    @torch.no_grad()
    def init_from_target(self, model: nn.Module) -> None:
        """Copy the target's final norm and LM head; zero the residual blocks (head i starts as the target's head)."""
        if not copy_final_norm(model, self.norm):
            raise ValueError(
                f"Medusa heads apply the target's final norm, but {type(model).__name__}'s is not an RMSNorm "
                "they can reproduce (x·w or x·(1+w)); this target is not supported by the medusa kind"
            )
        weight = model.get_output_embeddings().weight
        for lm_head in [self.lm_head] if self.config.shared_lm_head else self.lm_heads:
            lm_head.weight.copy_(weight)
        for block in self.modules():
            if isinstance(block, ResBlock):
                block.linear.weight.zero_()
                block.linear.bias.zero_()

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def head_logits(self, i: int, normed: torch.Tensor) -> torch.Tensor:
        """Head i's logits [..., V] from normed last hidden states [..., H]."""
        lm_head = self.lm_head if self.config.shared_lm_head else self.lm_heads[i]
        return self._softcap(lm_head(self.heads[i](normed)))

    def forward(
        self,
        hidden_states: torch.Tensor,
        logit_masks: torch.Tensor | None = None,
        num_heads: int | None = None,
    ) -> list[torch.Tensor]:
        """Target last-layer outputs (pre-norm) [..., H] → per head logits [..., V] (or [N_i, V] where
        ``logit_masks[i]`` [...] bool selects positions); only the first ``num_heads`` heads if given."""
        normed = self.norm(hidden_states.to(self.norm.weight.dtype))
        n = self.config.num_heads if num_heads is None else min(num_heads, self.config.num_heads)
        if self.config.shared_lm_head and logit_masks is None:  # one pass over the shared LM head's weight
            states = torch.stack([self.heads[i](normed) for i in range(n)])
            return list(self._softcap(self.lm_head(states)).unbind(0))
        return [
            self.head_logits(i, normed if logit_masks is None else normed[logit_masks[i]]) for i in range(n)
        ]


class MedusaDrafter(Drafter):
    """Proposes up to ``num_heads`` tokens at once from the target's feature at the last accepted position."""

    def __init__(self, heads: MedusaHeads, name: str = MEDUSA):
        self.heads = heads
        self.name = name
        self.capture_layers = tuple(heads.config.capture_layer_ids)
        self.feature: torch.Tensor | None = None  # [H]: its next token is the newest committed token

    def _last_feature(self, features: dict[int, torch.Tensor] | None) -> torch.Tensor:
        layer = self.capture_layers[0]
        if not features or layer not in features:
            raise ValueError(
                f"the Medusa drafter needs the target's features of layer {layer} at begin and every commit; "
                "set target.set_capture(drafter.capture_layers) before the prefill"
            )
        return features[layer][-1]

    def begin(self, prompt: torch.Tensor, features: dict[int, torch.Tensor] | None) -> None:
        self.feature = self._last_feature(features)

    @torch.inference_mode()
    def propose(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> Proposal:
        if k <= 0:
            return Proposal(tokens.new_empty(0))
        logits = torch.cat(self.heads(self.feature[None], num_heads=k)).float()  # [n, V]
        if sampling.greedy:
            return Proposal(logits.argmax(-1).to(tokens.device))
        probs = to_probs(logits, sampling)
        return Proposal(sample(probs, generator).to(tokens.device), probs)

    @torch.inference_mode()
    def propose_tree(
        self, tokens: torch.Tensor, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None
    ) -> DraftTree:
        """Level d's candidates are head d's top_k tokens under each of the best top_k nodes of level d-1
        (heads do not read the drafted tokens, so every parent gets the same children); scores add up
        the heads' log-probabilities along the path. Sibling sets are deterministic (top-k)."""
        depth = min(spec.depth, self.heads.config.num_heads)
        logits = torch.cat(self.heads(self.feature[None], num_heads=depth)).float()  # [depth, V]
        logprobs = logits.log_softmax(-1) if sampling.greedy else to_probs(logits, sampling).log()
        builder = TreeBuilder(int(tokens[-1]), logits.device)
        level = builder.add_children(
            torch.zeros(1, dtype=torch.long, device=logits.device), logprobs[:1], spec.top_k
        )
        for d in range(1, depth):
            frontier = builder.best(level, spec.top_k)
            if not frontier.numel():
                break
            level = builder.add_children(frontier, logprobs[d].expand(frontier.numel(), -1), spec.top_k)
        tree = builder.build(spec.total_tokens)
        return DraftTree(tree.tokens.to(tokens.device), tree.parents.to(tokens.device))

    def commit(self, num_accepted: int, features: dict[int, torch.Tensor] | None) -> None:
        self.feature = self._last_feature(features)


def _build(target, path: str) -> Drafter:
    if not path or not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"a Medusa draft needs a checkpoint directory saved by `draftsmith train` (got {path!r})"
        )
    heads = (
        MedusaHeads.from_pretrained(path, dtype=target.dtype).to(target.device).eval().requires_grad_(False)
    )
    check_target(heads.config.target, target, "Medusa draft", heads.config.layer_id_convention)
    return MedusaDrafter(heads, name=f"medusa:{Path(path).name}")


NO_ENGINE_LOADER = (
    "of the engines only vLLM loads Medusa heads (--to vllm, vLLM 0.32's MedusaModel): SGLang 0.5.23's released "
    "source has no Medusa loader and llama.cpp no Medusa graph; use the heads with `draftsmith eval`, or export "
    "them with --to hf or --to vllm"
)


def card_lines(config: dict) -> list[str]:
    return [
        target_layers_line(config),
        f"- {config.get('num_heads')} heads of {config.get('num_layers')} residual blocks each",
    ]


MEDUSA_HEADS = Family(MEDUSA, "Medusa heads", verify_hf=loads_strictly(MedusaHeads), card_lines=card_lines)
"""Medusa heads on the target's last hidden state (the family's name is the kind's)."""
register(DraftKind(MEDUSA, "Medusa draft", _build, MEDUSA_HEADS,
                   exports=(HF, VLLM), refusal=NO_ENGINE_LOADER))  # fmt: skip
