"""Tree drafting: masks and positions by hand, lossless greedy and sampled tree decoding, KV compaction."""

from __future__ import annotations

import functools
import itertools
import json
import math
import random

import pytest
import torch
from tiny import ARCHS, tiny_model, tiny_target, tiny_tokenizer

from draftsmith.cli import main
from draftsmith.decode.cost_model import TreeBudget
from draftsmith.decode.drafter import Drafter
from draftsmith.decode.sampling import Sampling, to_probs
from draftsmith.decode.speculative import generate
from draftsmith.decode.tree import (
    DraftTree,
    TreeBuilder,
    TreeSpec,
    accept_tree,
    tree_attention_mask,
    tree_position_ids,
    verify_tree_greedy,
    verify_tree_sampled,
)
from draftsmith.decode.tree_decode import compact_cache, generate_tree, tree_forward
from draftsmith.drafts.base import build_drafter
from draftsmith.drafts.eagle import EagleConfig, EagleHead
from draftsmith.drafts.eagle_drafter import EagleDrafter
from draftsmith.drafts.eagle_parts import build_vocab_map
from draftsmith.drafts.ngram import NgramDrafter

PROMPT_LEN, NEW = 24, 40  # longer than the tiny models' sliding window (16)

#        0 (root)
#       / \
#      1   2
#     / \    \
#    3   4    5
#    |
#    6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
TOKENS = [9, 1, 2, 3, 4, 5, 6]


def example_tree() -> DraftTree:
    return DraftTree(torch.tensor(TOKENS), torch.tensor(PARENTS))


def prompt(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(0, 250, (PROMPT_LEN // 2,), generator=g)
    return torch.cat([half, half])


def no_eos(target):
    target.eos_ids = set()
    return target


# --- structure, mask, positions, acceptance by hand -------------------------------------------


def test_mask_and_positions_match_hand_built():
    tree = example_tree()
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3] and tree.depth == 3 and tree.num_drafts == 6
    assert tree_position_ids(tree, 10).tolist() == [[10, 11, 11, 12, 12, 12, 13]]
    expected_tree = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    mask = tree_attention_mask(tree, prefix=2)
    assert mask.shape == (1, 1, 7, 9)
    assert mask[0, 0].int().tolist() == [[1, 1] + row for row in expected_tree]
    # sliding window 3: a node at depth d sees keys at most 2 positions back; prefix keys sit at -2, -1
    windowed = tree_attention_mask(tree, prefix=2, window=3)[0, 0].int().tolist()
    assert windowed[0] == [1, 1] + expected_tree[0]  # root (0): keys at -2, -1 are 2 and 1 back
    assert windowed[3] == [0, 0] + [1, 1, 0, 1, 0, 0, 0]  # depth 2: the prefix is 3 and 4 back
    assert windowed[6] == [0, 0] + [0, 1, 0, 1, 0, 0, 1]  # depth 3: the root is 3 back, hidden


def test_tree_validation_and_chain():
    with pytest.raises(ValueError, match="parents"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 1]))
    chain = DraftTree.chain(7, [1, 2, 3])
    assert chain.parents.tolist() == [-1, 0, 1, 2] and chain.depth == 3
    assert tree_attention_mask(chain, 0)[0, 0].int().tolist() == torch.ones(4, 4).tril().int().tolist()


def test_greedy_acceptance_follows_the_targets_argmax():
    tree = example_tree()
    chosen = torch.tensor([1, 3, 0, 6, 0, 0, 8])  # root→1 (token 1), 1→3 (token 3), 3→6 (token 6), bonus 8
    assert accept_tree(tree, chosen) == ([1, 3, 6], 8)
    assert accept_tree(tree, torch.tensor([2, 0, 7, 0, 0, 0, 0])) == ([2], 7)  # 2's only child is 5
    assert accept_tree(tree, torch.tensor([4, 0, 0, 0, 0, 0, 0])) == ([], 4)  # 4 is a grandchild only
    logits = torch.nn.functional.one_hot(torch.tensor([2, 0, 5, 0, 0, 8, 0]), 10).float()
    assert verify_tree_greedy(tree, logits) == ([2, 5], 8)


def test_builder_expands_by_cumulative_confidence_and_reranks():
    builder = TreeBuilder(root_token=0)
    lp = torch.tensor([[0.5, 0.3, 0.2]]).log()
    level1 = builder.add_children(torch.tensor([0]), lp, 2)  # tokens 0 (0.5) and 1 (0.3)
    assert builder.tokens.tolist() == [0, 0, 1] and level1.tolist() == [1, 2]
    frontier = builder.best(level1, 1)
    assert frontier.tolist() == [1]
    builder.add_children(frontier, torch.tensor([[0.1, 0.9, 0.0]]).log(), 2)  # 0.45 (token 1), 0.05 (token 0)
    tree = builder.build(3)  # scores: 0.5, 0.3, 0.45, 0.05 → keep 0.5, 0.45, 0.3
    assert tree.tokens.tolist() == [0, 0, 1, 1] and tree.parents.tolist() == [-1, 0, 0, 1]
    mapped = builder.build(2, token_map=torch.tensor([10, 11, 12]))
    assert mapped.tokens.tolist() == [0, 10, 11] and mapped.parents.tolist() == [-1, 0, 1]


def test_spec_parse():
    assert TreeSpec.parse("5,8,48") == TreeSpec(5, 8, 48)
    for bad in ("5,8", "a,b,c", "0,8,48"):
        with pytest.raises(ValueError, match="depth"):
            TreeSpec.parse(bad)


# --- lossless greedy decoding ------------------------------------------------------------------


class ScriptedTreeDrafter(Drafter):
    """Knows the target's greedy continuation; proposes random trees that hide it at a random depth.

    Every sibling set is random, the true path is cut at a random depth, so accepted paths of every
    length along every branch position are exercised.
    """

    name = "scripted-tree"

    def __init__(self, reference: list[int], seed: int = 0):
        self.reference, self.rng = reference, random.Random(seed)

    def begin(self, prompt, features):
        pass

    def propose(self, tokens, k, sampling, generator):
        raise AssertionError("the tree decoder must not call propose")

    def commit(self, num_accepted, features):
        pass

    def propose_tree(self, tokens, spec, sampling, generator):
        truth = self.reference[len(tokens) : len(tokens) + spec.depth]
        cut = self.rng.randint(0, len(truth))
        toks, parents, frontier = [int(tokens[-1])], [-1], [(0, True)]
        for d in range(spec.depth):
            grown = []
            for node, on_path in frontier:
                kids = {self.rng.randrange(259) for _ in range(self.rng.randint(0, spec.top_k))}
                if on_path and d < min(cut, len(truth)):
                    kids.add(truth[d])
                for tok in self.rng.sample(sorted(kids), len(kids)):
                    if len(toks) > spec.total_tokens:
                        break
                    toks.append(tok)
                    parents.append(node)
                    grown.append((len(toks) - 1, on_path and d < len(truth) and tok == truth[d]))
            frontier = grown
        return DraftTree(torch.tensor(toks), torch.tensor(parents))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tree_decoding_equals_target_greedy(arch):
    target = no_eos(tiny_target(arch))
    baseline = generate(target, prompt(), None, max_new_tokens=NEW)
    drafter = ScriptedTreeDrafter(prompt().tolist() + baseline.tokens)
    result = generate_tree(target, prompt(), drafter, TreeSpec(4, 3, 12), max_new_tokens=NEW)
    assert result.tokens == baseline.tokens
    assert sum(result.accepted) > len(result.accepted) // 2  # the true path was found on many steps
    assert result.target_forwards == len(result.accepted) + 1 < NEW
    assert target.length == PROMPT_LEN + NEW - 1


def test_tree_budget_chosen_online_keeps_greedy_output():
    target = no_eos(tiny_target("llama"))
    baseline = generate(target, prompt(), None, max_new_tokens=NEW)
    drafter = ScriptedTreeDrafter(prompt().tolist() + baseline.tokens)
    policy = TreeBudget(4, 3, budgets=(0, 2, 6, 12), warmup_rounds=1)
    result = generate_tree(target, prompt(), drafter, policy, max_new_tokens=NEW)
    assert result.tokens == baseline.tokens
    assert set(result.chosen_k) <= {0, 2, 6, 12} and result.chosen_k[:4] == [0, 12, 6, 2]
    assert len(result.chosen_k) == len(result.accepted)
    assert all(a == 0 for a, b in zip(result.accepted, result.chosen_k) if b == 0)  # plain steps


def _feed_budget(policy: TreeBudget, steps: int, tokens, seconds) -> list[int]:
    chosen = []
    for _ in range(steps):
        b = policy.choose()
        chosen.append(b)
        policy.record(b, tokens(b), seconds(b))
    return chosen


def test_tree_budget_picks_the_fastest_measured_budget_and_falls_back_to_plain():
    # tokens per step saturate with the budget; a step costs 10 ms + 1 ms per node: 16 nodes wins
    policy = TreeBudget(5, 4, budgets=(0, 4, 16, 64))
    tokens = {0: 1, 4: 1.5, 16: 3.5, 64: 3.8}
    chosen = _feed_budget(policy, 300, tokens.get, lambda b: 0.010 + 0.001 * b)
    assert policy.best_budget() == 16 and chosen[-100:].count(16) > 90
    # a useless draft that costs 5 ms a step: plain decoding wins
    policy = TreeBudget(5, 4, budgets=(0, 4, 16, 64))
    chosen = _feed_budget(policy, 300, lambda b: 1, lambda b: 0.010 + 0.005 * (b > 0) + 0.001 * b)
    assert policy.best_budget() == 0 and chosen[-100:].count(0) > 90
    with pytest.raises(ValueError, match="not one of"):
        policy.record(5, 1, 0.01)
    assert TreeSpec.parse_policy("5,8,48") == TreeSpec(5, 8, 48)
    assert isinstance(TreeSpec.parse_policy("5,8,auto"), TreeBudget)
    with pytest.raises(ValueError, match="depth,top_k,auto"):
        TreeSpec.parse_policy("5,auto,8")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_greedy_tree_decoding_with_an_eagle_head(arch):
    target = no_eos(tiny_target(arch, layers=8))
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target, "eagle3", draft_vocab_size=120)).eval()
    head.init_from_target(target.model)
    baseline = generate(target, prompt(), None, max_new_tokens=NEW)
    result = generate_tree(target, prompt(), EagleDrafter(head), TreeSpec(3, 4, 10), max_new_tokens=NEW)
    assert result.tokens == baseline.tokens
    assert max(result.proposed) == 3


def test_eagle_tree_nodes_see_exactly_their_own_path(monkeypatch):
    """The head's hidden state at every expanded tree node equals chain drafting along that node's path."""
    target = no_eos(tiny_target("qwen2", layers=8))
    torch.manual_seed(1)
    head = EagleHead(EagleConfig.for_target(target, "eagle3", draft_vocab_size=120)).eval()
    drafter = EagleDrafter(head)
    target.reset()
    target.set_capture(drafter.capture_layers)
    step = target.forward(prompt())
    tokens = torch.cat([prompt(), step.logits[-1:].argmax(-1)])
    spec = TreeSpec(depth=3, top_k=3, total_tokens=1000)  # keep every candidate, in creation order
    drafter.begin(prompt(), step.features)
    seen: list[torch.Tensor] = []  # hidden states scored, per expansion: the root, then each level's frontier
    scored = drafter._logprobs
    monkeypatch.setattr(
        drafter, "_logprobs", lambda hidden, sampling: seen.append(hidden) or scored(hidden, sampling)
    )
    tree = drafter.propose_tree(tokens, spec, Sampling(), None)
    monkeypatch.undo()
    assert tree.num_drafts == 3 + 2 * 3 * 3
    parents, tree_tokens = tree.parents.tolist(), tree.tokens.tolist()
    # children are created in expansion order, so an expanded node's first child id orders the expansions
    expanded = sorted({p for p in parents if p >= 0}, key=parents.index)
    assert len(expanded) == 1 + 3 + 3
    for node, hidden_in_tree in zip(expanded, torch.cat(seen)):
        path, up = [], node
        while up > 0:
            path.insert(0, tree_tokens[up])
            up = parents[up]
        drafter.begin(prompt(), step.features)
        hidden = drafter._catch_up(tokens)
        for i, tok in enumerate(path):
            hidden = drafter._step(hidden, torch.tensor([tok]), drafter.cached_len + i)
        assert torch.allclose(hidden_in_tree, hidden[-1], atol=1e-5), f"node {node} (path {path})"
        children = {tree_tokens[i] for i, p in enumerate(parents) if p == node}
        assert children == set(head.d2t[head.draft_logits(hidden)[-1].topk(3).indices].tolist())
    # a top-1 tree is the greedy chain
    drafter.begin(prompt(), step.features)
    chain = drafter.propose(tokens, 3, Sampling(), None)
    drafter.begin(prompt(), step.features)
    tree = drafter.propose_tree(tokens, TreeSpec(3, 1, 3), Sampling(), None)
    assert tree.tokens[1:].tolist() == chain.tokens.tolist() and tree.parents.tolist() == [-1, 0, 1, 2]


def test_chain_drafting_feeds_the_head_target_ids_as_training_does():
    """With a reduced draft vocabulary (d2t not the identity) drafting matches the head's TTT unroll."""
    target = no_eos(tiny_target("llama", layers=8))
    torch.manual_seed(2)
    head = EagleHead(EagleConfig.for_target(target, "eagle3", draft_vocab_size=120)).eval()
    head.set_vocab_map(*build_vocab_map(torch.arange(target.vocab_size), 120))  # ids 139..258
    drafter = EagleDrafter(head)
    target.reset()
    target.set_capture(drafter.capture_layers)
    step = target.forward(prompt())
    tokens = torch.cat([prompt(), step.logits[-1:].argmax(-1)])
    drafter.begin(prompt(), step.features)
    sampling = Sampling(temperature=1.0)
    proposal = drafter.propose(tokens, 3, sampling, torch.Generator().manual_seed(0))
    ids = torch.cat([tokens, proposal.tokens])[None]
    feats = {
        i: torch.nn.functional.pad(f, (0, 0, 0, ids.shape[1] - f.shape[0]))[None]
        for i, f in step.features.items()
    }
    anchor = PROMPT_LEN - 1  # the last real pair: (feature of the last prompt token, first generated token)
    for j, logits in enumerate(head(ids, feats, steps=3).logits):
        assert torch.allclose(proposal.probs[j, head.d2t], to_probs(logits[0, anchor], sampling), atol=1e-5)


def test_ngram_tree_and_chain_only_drafters():
    target = no_eos(tiny_target("llama"))
    baseline = generate(target, prompt(), None, max_new_tokens=NEW)
    result = generate_tree(target, prompt(), NgramDrafter(), TreeSpec(4, 2, 8), max_new_tokens=NEW)
    assert result.tokens == baseline.tokens and sum(result.accepted) > 0
    layers = build_drafter("layers:2", target)
    assert not layers.supports_tree and NgramDrafter().supports_tree
    with pytest.raises(NotImplementedError, match="layers:2.*drafts chains only"):
        generate_tree(target, prompt(), layers, TreeSpec(3, 2, 6), max_new_tokens=8)


# --- KV compaction -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2"])
def test_compacted_cache_equals_a_fresh_forward(arch):
    target = no_eos(tiny_target(arch))
    g = torch.Generator().manual_seed(3)
    for path in ([], [2, 5], [1, 3, 6]):
        target.reset()
        target.forward(prompt())
        tree = DraftTree(torch.randint(0, 256, (7,), generator=g), torch.tensor(PARENTS))
        step = tree_forward(target, tree)
        keep = torch.tensor([0, *path])
        compact_cache(target.cache, len(tree), keep)
        assert target.length == PROMPT_LEN + keep.numel()
        nxt = torch.randint(0, 256, (2,), generator=g)
        after = target.forward(nxt).logits
        sequence = torch.cat([prompt(), tree.tokens[keep], nxt])
        target.reset()
        fresh = target.forward(sequence).logits
        assert torch.allclose(step.logits[keep], fresh[PROMPT_LEN : PROMPT_LEN + keep.numel()], atol=1e-4)
        assert torch.allclose(after, fresh[-2:], atol=1e-4)


# --- the statistical test of tree sampling -----------------------------------------------------

V, LENGTH = 3, 3
TARGET = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.7, 0.2]])  # P(next | prev)
DRAFT = torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.4, 0.1], [0.3, 0.3, 0.4]])  # Q(next | prev), far from P
START = 0
SPEC = TreeSpec(depth=2, top_k=2, total_tokens=4)
# 27 outcomes; with 4.5 standard errors as the bound a correct rule fails with probability < 2e-4.
# The broken rule below lands near 60 standard errors at 6000 samples, so 1500 still fail it by far.
BOUND, SAMPLES, BROKEN_SAMPLES = 4.5, 6000, 1500


@functools.cache
def markov_tree(prev: int) -> DraftTree:
    """A dynamic tree for the Markov draft: the same builder EAGLE drafting uses (deterministic, so cached)."""
    builder = TreeBuilder(prev)
    level = builder.add_children(torch.tensor([0]), DRAFT[[prev]].log(), SPEC.top_k)
    for _ in range(1, SPEC.depth):
        frontier = builder.best(level, SPEC.top_k)
        level = builder.add_children(frontier, DRAFT[builder.tokens[frontier]].log(), SPEC.top_k)
    return builder.build(SPEC.total_tokens)


def tree_sequence(verify, generator: torch.Generator) -> tuple[int, ...]:
    seq: list[int] = []
    while len(seq) < LENGTH:
        tree = markov_tree(seq[-1] if seq else START)
        path, nxt = verify(tree, TARGET[tree.tokens], generator)
        seq.extend(tree.tokens[path].tolist() + [nxt])
    return tuple(seq[:LENGTH])


def max_normalised_deviation(verify, samples: int) -> float:
    g = torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(samples):
        s = tree_sequence(verify, g)
        counts[s] = counts.get(s, 0) + 1
    worst = 0.0
    for seq in itertools.product(range(V), repeat=LENGTH):
        p, prev = 1.0, START
        for tok in seq:
            p, prev = p * float(TARGET[prev, tok]), tok
        worst = max(worst, abs(counts.get(seq, 0) / samples - p) / math.sqrt(p * (1 - p) / samples))
    return worst


def verify_as_if_sampled_from_q(tree: DraftTree, target_probs, generator):
    """A broken rule: multi-draft rejection (accept with p/q, move to norm(max(0, p - q))) on top-k children."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    node, path = 0, []
    while True:
        p, q = target_probs[node].clone(), DRAFT[tokens[node]]
        for child in [i for i, par in enumerate(parents) if par == node]:
            if float(torch.rand(1, generator=generator)) * float(q[tokens[child]]) < float(p[tokens[child]]):
                node = child
                path.append(child)
                break
            p = (p - q).clamp_min(0)
            p = p / p.sum() if p.sum() > 0 else target_probs[node]
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))


def test_tree_sampling_matches_target_distribution():
    assert markov_tree(0).num_drafts == 4 and markov_tree(0).depth == 2
    assert max_normalised_deviation(verify_tree_sampled, SAMPLES) < BOUND


def test_broken_tree_sampling_rule_fails_the_same_test():
    assert max_normalised_deviation(verify_as_if_sampled_from_q, BROKEN_SAMPLES) > BOUND


def test_sampled_tree_decoding_runs_and_is_reproducible():
    target = no_eos(tiny_target("gemma2", layers=8))
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target, "eagle3", draft_vocab_size=120)).eval()
    sampling = Sampling(temperature=0.8, top_k=50)
    runs = [
        generate_tree(
            target,
            prompt(),
            EagleDrafter(head),
            TreeSpec(3, 3, 8),
            max_new_tokens=20,
            sampling=sampling,
            generator=torch.Generator().manual_seed(5),
        ).tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 20


# --- draftsmith eval --tree --------------------------------------------------------------------


def test_eval_cli_with_tree(tmp_path, capsys):
    model = tmp_path / "model"
    tiny_model("llama").save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc abc abc abc abc", "category": "code"}) + "\n")
    argv = ["eval", "--target", str(model), "--prompts", str(prompts), "--max-new-tokens", "10"]
    argv += ["--device", "cpu", "--warmup", "0", "--out", str(tmp_path / "out")]
    assert main([*argv, "--draft", "ngram", "--tree", "3,2,6"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["settings"]["tree"] == "3,2,6" and report["drafts"][0]["exact_match"] is True
    capsys.readouterr()
    assert main([*argv, "--overwrite", "--draft", "layers:2", "--tree", "3,2,6"]) != 0
    assert "layers:2 draft chains only" in capsys.readouterr().err
    assert main([*argv, "--draft", "ngram", "--tree", "3,2,auto", "--out", str(tmp_path / "auto")]) == 0
    auto = json.loads((tmp_path / "auto" / "report.json").read_text())["drafts"][0]
    assert auto["exact_match"] is True and set(auto["chosen_k"]) <= {"0", "4", "8", "16", "32", "48", "64"}
    capsys.readouterr()
    assert main([*argv, "--draft", "ngram", "--tree", "3,2"]) != 0
    assert "depth,top_k,total_tokens" in capsys.readouterr().err
