"""Prompt lookup (n-gram) drafting: no model, no training.

Find the most recent earlier occurrence of the context's last n tokens (n from ``max_n`` down to
``min_n``) and propose the tokens that followed it. Deterministic, so proposals are one-hot.
"""

from __future__ import annotations

import torch

from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.decode.sampling import Sampling
from draftsmith.decode.tree import DraftTree, TreeSpec
from draftsmith.drafts.base import NGRAM, TRAINING_FREE, DraftKind, register


class NgramDrafter(Drafter):
    capture_layers = ()

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"n-gram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}"
            )
        self.max_n, self.min_n = max_n, min_n
        self.name = f"ngram:{max_n}"

    def begin(self, prompt: torch.Tensor, features: dict[int, torch.Tensor] | None) -> None:
        pass

    def propose(
        self, tokens: torch.Tensor, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> Proposal:
        return Proposal(lookup(tokens, k, self.max_n, self.min_n))

    def commit(self, num_accepted: int, features: dict[int, torch.Tensor] | None) -> None:
        pass

    def batched(self, batch_size: int) -> BatchedNgram:
        return BatchedNgram(self)

    def propose_tree(
        self, tokens: torch.Tensor, spec: TreeSpec, sampling: Sampling, generator: torch.Generator | None
    ) -> DraftTree:
        seq = tokens.view(-1).cpu()
        nodes: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        parents, toks = [-1], [int(seq[-1])]
        for continuation in continuations(seq, spec.depth, self.max_n, self.min_n):
            node = 0
            for tok in continuation:
                child = nodes.get((node, tok))
                if child is None:
                    siblings = sum(1 for parent, _ in nodes if parent == node)
                    if len(toks) > spec.total_tokens or siblings >= spec.top_k:
                        break
                    child = nodes[(node, tok)] = len(toks)
                    parents.append(node)
                    toks.append(tok)
                node = child
            if len(toks) > spec.total_tokens:
                break
        return DraftTree(
            torch.tensor(toks, device=tokens.device), torch.tensor(parents, device=tokens.device)
        )


def lookup(tokens: torch.Tensor, k: int, max_n: int, min_n: int = 1) -> torch.Tensor:
    """Up to k tokens that followed the latest earlier match of the last n tokens (longest n first)."""
    seq = tokens.view(-1).cpu()
    length = seq.shape[0]
    if k <= 0:
        return seq.new_empty(0).to(tokens.device)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = seq[-n:]
        windows = seq[: length - 1].unfold(0, n, 1)  # every n-gram that ends before the last token
        hits = (windows == pattern).all(-1).nonzero().view(-1)
        if hits.numel():
            start = int(hits[-1]) + n
            return seq[start : start + k].to(tokens.device)
    return seq.new_empty(0).to(tokens.device)


def continuations(seq: torch.Tensor, length: int, max_n: int, min_n: int = 1):
    """Yield the up-to-``length`` tokens after every earlier match of the last n tokens, longest n and latest first."""
    total = seq.shape[0]
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        windows = seq[: total - 1].unfold(0, n, 1)
        for hit in (windows == seq[-n:]).all(-1).nonzero().view(-1).flip(0).tolist():
            yield seq[hit + n : hit + n + length].tolist()


def _build(target, arg: str) -> Drafter:
    if arg and not arg.isdigit():
        raise ValueError(f"an n-gram draft takes a match length, e.g. 'ngram:3' (got 'ngram:{arg}')")
    return NgramDrafter(max_n=int(arg)) if arg else NgramDrafter()


register(DraftKind(NGRAM, "n-gram drafter", _build, TRAINING_FREE,
                   refusal="it is training-free: serve with the engine's own n-gram drafting"))  # fmt: skip


class BatchedNgram:
    """n-gram lookup per row: nothing to keep between steps."""

    def __init__(self, drafter: NgramDrafter):
        self.max_n, self.min_n = drafter.max_n, drafter.min_n

    def propose(self, tokens: list[list[int]], ks: list[int]) -> list[list[int]]:
        return [lookup(torch.tensor(t), k, self.max_n, self.min_n).tolist() for t, k in zip(tokens, ks)]

    def commit(self, accepted: list[int]) -> None:
        pass

    def select(self, rows: torch.Tensor) -> None:
        pass
