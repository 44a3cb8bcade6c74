"""Draft trees: their layout, EAGLE-2-style dynamic expansion, the verify mask and the acceptance rules.

Layout. A ``DraftTree`` holds ``N + 1`` nodes in topological order: node 0 is the root (the last
committed token, which the target has not cached yet) and nodes 1..N are draft tokens, each with
``parents[i] < i``. Depth 0 is the root; a node at depth d sits at sequence position ``P + d`` where P
is the number of tokens the target has cached. Siblings carry distinct tokens.

Dynamic expansion (EAGLE-2). ``TreeBuilder`` grows a pool of candidates: each expanded node gets its
``top_k`` most likely draft tokens as children, scored by cumulative log-confidence (the sum of the
draft's log-probabilities along the path). At every depth only the ``top_k`` best-scored nodes are
expanded; at the end all candidates are reranked and the best ``total_tokens`` are kept. Scores never
rise along a path, so the kept set (ties broken by creation order) always contains every kept node's
parent: it is a tree.

Verification. The target runs once over the N + 1 nodes with ``tree_position_ids`` and a 4D mask
(``tree_attention_mask``) in which a node sees the cached prefix and its own ancestors (itself
included), and, in sliding-window layers, only keys less than ``window`` positions back.

Acceptance. The target chooses one token at each node (greedy: its argmax; sampled: one draw from its
distribution there) and ``accept_tree`` walks from the root while the chosen token is a child of the
current node; the token chosen at the last node reached is appended (correction or bonus).

Why the sampled rule is lossless. The children of a node are chosen deterministically (top-k of the
draft given the context), not drawn at random. For a deterministic candidate set C the rule is "draw
x ~ p (the target's distribution at the node); if x is in C move to that child, else emit x and stop".
It emits exactly one draw from p at each position, so the committed sequence is distributed as
sampling from the target token by token. It is the recursive rejection rule for one-hot proposals:
accept c_1 with probability min(1, p(c_1) / 1) = p(c_1); on rejection the residual
norm(max(0, p - onehot(c_1))) is p with c_1 removed; accept c_2 with its residual probability, and so
on; after the last rejection draw from p with all of C removed — the same law as one draw from p.
The acceptance rate at a node is p(C), the most any rule can reach with these candidates. The
multi-draft rule for candidates *sampled* from the draft q (accept with min(1, p/q), then move to
norm(max(0, p - q))) is NOT lossless for top-k candidates; tests/test_tree.py shows it fails the
statistical test that this rule passes. Drawing one x per node for all nodes at once is the same law
as drawing only at the visited nodes, since the walk reads only the draws at nodes it visits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeSpec:
    """The shape of a dynamic draft tree (EAGLE-2's ``depth``, ``top_k``, ``total_token``)."""

    depth: int
    """Draft levels below the root: the most draft tokens one verify step can accept."""
    top_k: int
    """Children per expanded node, and nodes expanded per depth."""
    total_tokens: int
    """Draft nodes kept after reranking (the verify forward sees total_tokens + 1 positions)."""

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise ValueError(
                f"tree depth, top_k and total_tokens must all be >= 1, got {self.depth},{self.top_k},"
                f"{self.total_tokens}; e.g. --tree 5,8,48"
            )

    @classmethod
    def parse(cls, text: str) -> TreeSpec:
        """``"depth,top_k,total_tokens"`` → TreeSpec (e.g. ``"5,8,48"``)."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(
                f"--tree takes depth,top_k,total_tokens as three integers, e.g. 5,8,48, or depth,top_k,auto "
                f"(got {text!r})"
            )
        return cls(*(int(p) for p in parts))

    @staticmethod
    def parse_policy(text: str):
        """``--tree`` as eval takes it: ``"5,8,48"`` → a TreeSpec; ``"5,8,auto"`` → a ``TreeBudget``
        (decode/cost_model.py) that picks the node budget per step for that depth and top_k."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) == 3 and parts[2] == "auto":
            from draftsmith.decode.cost_model import TreeBudget

            spec = TreeSpec.parse(f"{parts[0]},{parts[1]},1")
            return TreeBudget(spec.depth, spec.top_k)
        return TreeSpec.parse(text)


@dataclass
class DraftTree:
    """Nodes in topological order; node 0 is the root. tokens / parents: [N + 1] int64 (parents[0] = -1)."""

    tokens: torch.Tensor
    parents: torch.Tensor

    def __post_init__(self) -> None:
        parents = self.parents.tolist()
        if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
            raise ValueError(f"a draft tree needs parents[0] = -1 and 0 <= parents[i] < i, got {parents}")
        if self.tokens.shape != self.parents.shape:
            raise ValueError(
                f"tree tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} differ"
            )
        depths = [0] * len(parents)
        for i in range(1, len(parents)):
            depths[i] = depths[parents[i]] + 1
        self.depths = torch.tensor(depths, device=self.tokens.device)

    @classmethod
    def chain(cls, root: int, drafts: list[int], device: torch.device | str = "cpu") -> DraftTree:
        """A tree that is one path: root, drafts[0], drafts[1], ..."""
        tokens = torch.tensor([root, *drafts], device=device)
        return cls(tokens, torch.arange(-1, len(drafts), device=device))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_drafts(self) -> int:
        return len(self) - 1

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def ancestry(self) -> torch.Tensor:
        """[N + 1, N + 1] bool: ``[i, j]`` is True when node j is node i or one of its ancestors."""
        n = len(self)
        anc = torch.eye(n, dtype=torch.bool, device=self.tokens.device)
        for d in range(1, self.depth + 1):  # parents are complete before their children's level
            rows = (self.depths == d).nonzero().view(-1)
            anc[rows] |= anc[self.parents[rows]]
        return anc


def tree_position_ids(tree: DraftTree, cached: int) -> torch.Tensor:
    """[1, N + 1] positions of the tree nodes after ``cached`` committed positions: cached + depth."""
    return (tree.depths + cached)[None]


def tree_attention_mask(tree: DraftTree, prefix: int, window: int | None = None) -> torch.Tensor:
    """[1, 1, N + 1, prefix + N + 1] bool (True = attend) for one verify forward over the tree.

    Keys: the ``prefix`` most recent cached positions (they end right before the root), then the tree
    nodes in order. A node sees the prefix and its ancestors and itself; with ``window`` (a sliding
    window layer) only keys fewer than ``window`` positions behind it, as transformers' sliding masks do.
    """
    anc = tree.ancestry()
    device = anc.device
    allowed = torch.cat([torch.ones(len(tree), prefix, dtype=torch.bool, device=device), anc], dim=1)
    if window is not None:
        key_pos = torch.cat([torch.arange(-prefix, 0, device=device), tree.depths])
        allowed &= (tree.depths[:, None] - key_pos[None, :]) < window
    return allowed[None, None]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the float mask every attention implementation adds to its scores (0 or dtype min)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def accept_tree(tree: DraftTree, chosen: torch.Tensor) -> tuple[list[int], int]:
    """Walk from the root while the target's chosen token [N + 1] at a node is one of its children.

    Returns (accepted node ids along the path, root excluded; the chosen token at the last node).
    """
    tokens, parents, chosen = tree.tokens.tolist(), tree.parents.tolist(), chosen.tolist()
    children: dict[tuple[int, int], int] = {}
    for i in range(1, len(tokens)):
        children.setdefault((parents[i], tokens[i]), i)
    path, node = [], 0
    while (node, chosen[node]) in children:
        node = children[(node, chosen[node])]
        path.append(node)
    return path, int(chosen[node])


def verify_tree_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """The longest path whose every node is the target's argmax at its parent; then the target's argmax."""
    return accept_tree(tree, target_logits.argmax(-1))


def verify_tree_sampled(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Lossless tree sampling for deterministic sibling sets (module docstring): one draw from p per node."""
    chosen = torch.multinomial(target_probs, 1, generator=generator).view(-1)
    return accept_tree(tree, chosen)


class TreeBuilder:
    """A pool of candidate nodes grown by dynamic expansion; ``build`` reranks it into a ``DraftTree``.

    Node 0 is the root. Scores are cumulative log-confidences (root 0). Tokens are whatever ids the
    caller expands with (an EAGLE-3 head's draft ids); ``build`` can map them to target ids.
    """

    def __init__(self, root_token: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.tokens = torch.tensor([root_token], device=self.device)
        self.parents = torch.tensor([-1], device=self.device)
        self.scores = torch.zeros(1, device=self.device)
        self.depths = torch.zeros(1, dtype=torch.long, device=self.device)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def add_children(self, nodes: torch.Tensor, logprobs: torch.Tensor, k: int) -> torch.Tensor:
        """Give each of ``nodes`` [m] its k most likely tokens under ``logprobs`` [m, V]; new node ids [m * k]."""
        k = min(k, logprobs.shape[-1])
        top = logprobs.float().topk(k, dim=-1)
        start = len(self)
        self.tokens = torch.cat([self.tokens, top.indices.reshape(-1)])
        self.parents = torch.cat([self.parents, nodes.repeat_interleave(k)])
        self.scores = torch.cat([self.scores, (self.scores[nodes, None] + top.values).reshape(-1)])
        self.depths = torch.cat([self.depths, (self.depths[nodes] + 1).repeat_interleave(k)])
        return torch.arange(start, len(self), device=self.device)

    def best(self, nodes: torch.Tensor, k: int) -> torch.Tensor:
        """The (at most) k best-scored of ``nodes`` with a finite score, best first."""
        scores = self.scores[nodes]
        order = scores.topk(min(k, nodes.numel())).indices
        keep = nodes[order]
        return keep[torch.isfinite(self.scores[keep])]

    def build(self, total_tokens: int, token_map: torch.Tensor | None = None) -> DraftTree:
        """Keep the ``total_tokens`` best-scored candidates (and the root) as a tree.

        ``token_map`` [Vd] maps candidate ids to target ids (the root's id is kept as it is).
        """
        scores = self.scores[1:]
        finite = torch.isfinite(scores).nonzero().view(-1)
        # stable sort on -score: among equal scores earlier (shallower) nodes win, so parents precede children
        order = torch.sort(-scores[finite], stable=True).indices[:total_tokens]
        kept = (finite[order] + 1).sort().values  # creation order is topological
        index = torch.full((len(self),), -1, dtype=torch.long, device=self.device)
        index[0] = 0
        index[kept] = torch.arange(1, kept.numel() + 1, device=self.device)
        parents = torch.cat([self.parents[:1], index[self.parents[kept]]])
        tokens = self.tokens[kept]
        if token_map is not None:
            tokens = token_map[tokens]
        return DraftTree(torch.cat([self.tokens[:1], tokens]), parents)
