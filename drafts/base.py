"""The one protocol every drafter speaks, and the registry that builds drafters from a spec string.

A decode step, as the decoder drives it (``decode/speculative.py``):

1. ``begin(prompt, features)`` once per sequence, after the target's prefill over the prompt.
2. ``propose(tokens, k, ...)`` → up to k draft tokens (and the distributions they came from).
3. The target verifies; ``commit(num_accepted, features)`` tells the drafter how many of its
   tokens were kept, so it can roll its own state (KV cache, feature buffer) back to match.

``features`` are the target's hidden states at the positions the target just processed, for the
layers listed in ``capture_layers`` (0-based "output of layer i", see ``decode/features.py``):
``{layer_id: [S, H]}``. At ``begin`` S is the prompt length; at ``commit`` S is
``num_accepted + 1`` — the last committed token before the step and the accepted draft tokens.
The token the target appended (correction or bonus) has no features yet; it arrives as the last
entry of ``tokens`` in the next ``propose``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from draftsmith.decode.sampling import Sampling

if TYPE_CHECKING:
    from draftsmith.decode.target import Target


@dataclass
class Proposal:
    """Drafted tokens [n] (n <= k) and, for sampled drafts, the distributions [n, V] they were drawn from.

    ``probs is None`` marks a deterministic proposal (one-hot): n-gram lookup, greedy drafting.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Drafter(ABC):
    """Proposes draft tokens for a target. One instance serves one sequence at a time."""

    name: str = "drafter"
    capture_layers: tuple[int, ...] = ()
    """Target layers (0-based outputs) whose hidden states this drafter reads; empty for most."""

    @abstractmethod
    def begin(self, prompt: torch.Tensor, features: dict[int, torch.Tensor] | None) -> None:
        """Start a new sequence. prompt: [S] token ids the target has just prefilled."""

    @abstractmethod
    def propose(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> Proposal:
        """Draft up to k tokens to follow ``tokens`` [L] (every committed token, the newest last)."""

    @abstractmethod
    def commit(self, num_accepted: int, features: dict[int, torch.Tensor] | None) -> None:
        """The target kept the first ``num_accepted`` tokens of the last proposal; roll back the rest."""


DrafterFactory = Callable[["Target", str], Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register(kind: str) -> Callable[[DrafterFactory], DrafterFactory]:
    """Register a factory ``(target, argument) -> Drafter`` under a kind name (``ngram``, ``layers``, ...)."""

    def wrap(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[kind] = factory
        return factory

    return wrap


def registered_kinds() -> list[str]:
    return sorted(_REGISTRY)


def build_drafter(spec: str, target: Target) -> Drafter:
    """Build a drafter from a spec: ``ngram``, ``ngram:N``, ``layers:N``, or a path / model id.

    A directory saved by draftsmith names its kind in ``config.json`` (``draftsmith_kind``) and is
    built by that kind; any other path or model id is loaded as an independent causal-LM draft.
    """
    import draftsmith.drafts  # noqa: F401  (imports every kind so it registers)
    from draftsmith.drafts.loading import kind_of_checkpoint

    kind, _, arg = spec.partition(":")
    if kind in _REGISTRY and kind not in ("causal_lm",):
        return _REGISTRY[kind](target, arg)
    kind = kind_of_checkpoint(spec)
    if kind not in _REGISTRY:
        raise ValueError(
            f"draft {spec!r} is a draftsmith checkpoint of kind {kind!r}, which this version cannot load "
            f"(known kinds: {', '.join(registered_kinds())})"
        )
    return _REGISTRY[kind](target, spec)
