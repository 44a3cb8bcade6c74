"""The one protocol every drafter speaks, as the decoders drive it.

A decode step (``decode/speculative.py``):

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

Optional capabilities, each asked of the drafter (the decoders never check its class): trees
(``supports_tree``, ``propose_tree``, ``commit_tree``) and batches (``batched``) here; a decoding mode
that needs more of a drafter states it beside its decoder, as a protocol the drafter implements (mirror
decoding: ``GridDrafter`` in ``decode/mirror.py``), so this base knows no mode. The kinds of draft live
in ``drafts/``, above this layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from draftsmith.decode.sampling import Sampling

if TYPE_CHECKING:
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

    # -- batched decoding (optional; decode/batched.py) --------------------------------------------

    def batched(self, batch_size: int) -> BatchedDrafter | None:
        """A drafter for ``batch_size`` sequences decoded together, or None when this one has none."""
        return None

    def commit_tree(self, accepted: list[int], features: dict[int, torch.Tensor] | None) -> None:
        """The target kept the tree nodes ``accepted`` (one path from the root, root excluded).

        ``features`` cover the root and the accepted nodes, in that order. The default suits drafters
        whose state holds nothing of a proposal after ``commit`` (it forwards the count to ``commit``);
        a drafter that keeps draft entries of the tree must override it.
        """
        self.commit(len(accepted), features)


class BatchedDrafter(Protocol):
    """Greedy drafting for a batch (``decode/batched.py``): rows are sequences, all lists are per row."""

    def propose(self, tokens: list[list[int]], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[b]`` draft tokens after row b's committed ``tokens[b]``."""

    def commit(self, accepted: list[int]) -> None:
        """Row b kept the first ``accepted[b]`` tokens of its last proposal."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished sequences leave the batch)."""
