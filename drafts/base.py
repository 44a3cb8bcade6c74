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
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from draftsmith.decode.sampling import Sampling

if TYPE_CHECKING:
    from draftsmith.decode.target import Target
    from draftsmith.decode.tree import DraftTree, TreeSpec


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

    # -- tree drafting (optional; decode/tree_decode.py) -------------------------------------------

    @property
    def supports_tree(self) -> bool:
        """Whether ``propose_tree`` is implemented (``--tree`` in ``draftsmith eval`` needs it)."""
        return type(self).propose_tree is not Drafter.propose_tree

    def propose_tree(
        self, tokens: torch.Tensor, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None
    ) -> DraftTree:
        """Draft a token tree rooted at ``tokens[-1]`` no deeper than ``spec.depth`` (``decode/tree.py``).

        Sibling sets must be chosen deterministically given the context (e.g. the draft's top-k): the
        lossless tree sampling rule relies on it.
        """
        raise NotImplementedError(
            f"drafter {self.name!r} ({type(self).__name__}) drafts chains only and cannot propose a tree; "
            "drop --tree for it, or use a drafter that drafts trees (an EAGLE head, ngram)"
        )

    def commit_tree(self, accepted: list[int], features: dict[int, torch.Tensor] | None) -> None:
        """The target kept the tree nodes ``accepted`` (one path from the root, root excluded).

        ``features`` cover the root and the accepted nodes, in that order. The default suits drafters
        whose state holds nothing of a proposal after ``commit`` (it forwards the count to ``commit``);
        a drafter that keeps draft entries of the tree must override it.
        """
        self.commit(len(accepted), features)


RUN_DRAFT = "draft"
"""Where a ``draftsmith train`` run directory keeps its draft: ``--draft RUN`` reads ``RUN/draft``."""

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
    from draftsmith.hub import resolve_pretrained

    spec = resolve_pretrained(spec, what="draft")  # a Hub id becomes its local snapshot (cache first)
    run_draft = Path(spec) / RUN_DRAFT
    if not (Path(spec) / "config.json").is_file() and (run_draft / "config.json").is_file():
        spec = str(run_draft)  # a `draftsmith train` run directory: its draft
    elif Path(spec).is_dir() and not (Path(spec) / "config.json").is_file():
        raise FileNotFoundError(
            f"--draft {spec} holds no draft: expected config.json in it (a draft directory) or draft/config.json "
            "(a `draftsmith train` run directory; it appears once the run has validated)"
        )
    kind = kind_of_checkpoint(spec)
    if kind not in _REGISTRY:
        raise ValueError(
            f"draft {spec!r} is a draftsmith checkpoint of kind {kind!r}, which this version cannot load "
            f"(known kinds: {', '.join(registered_kinds())})"
        )
    return _REGISTRY[kind](target, spec)
