"""The tree decoder: a drafter proposes a token tree, the target verifies all of it in one forward.

Each step: the drafter builds a ``DraftTree`` rooted at the last committed token (``decode/tree.py``);
the target runs once over the tree's nodes with tree position ids and a tree attention mask on top of
its KV cache; the longest path the target agrees with (greedy) or the path its draws follow (sampled,
lossless) is kept; ``compact_cache`` gathers the root and that path out of the tree's entries in every
cache layer, so the cache again holds one contiguous sequence; the drafter hears which nodes were kept.

Sliding-window layers get their own mask (they hold only the last ``window - 1`` prefix positions), so
a model mixing full and sliding layers must take a mapping {layer type: mask}, as transformers' Gemma
and Qwen models do; a model that takes one mask for all layers is fine when all its layers agree.
"""

from __future__ import annotations

import functools
import inspect
import time

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from draftsmith.decode.cost_model import TreeBudget
from draftsmith.decode.drafter import Drafter
from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.decode.speculative import GREEDY, GenerationResult, commit_tokens, sync
from draftsmith.decode.target import Target, TargetStep
from draftsmith.decode.tree import (
    DraftTree,
    TreeSpec,
    additive_mask,
    tree_attention_mask,
    tree_position_ids,
    verify_tree_greedy,
    verify_tree_sampled,
)

MASK_IMPLEMENTATIONS = ("eager", "sdpa")


def _layer_views(cache: DynamicCache) -> list[tuple[int, int | None]]:
    """Per cache layer: (cached positions its attention will see, sliding window or None)."""
    views = []
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer:
            seen = layer.get_seq_length()
            views.append((min(seen, layer.sliding_window - 1), layer.sliding_window))
        elif type(layer) is DynamicLayer:
            views.append((layer.get_seq_length(), None))
        else:
            raise ValueError(
                f"tree verification needs every KV cache layer to be a transformers DynamicLayer or "
                f"DynamicSlidingWindowLayer; this target's cache has a {type(layer).__name__}. "
                "Use chain drafting (no --tree) with this target."
            )
    return views


@functools.cache
def _takes_mask_mapping(decoder_class: type) -> bool:
    """Whether the decoder's forward accepts {layer type: 4D mask} as attention_mask (Gemma, Qwen, ...)."""
    forward = inspect.unwrap(decoder_class.forward)
    try:
        return "causal_mask_mapping := attention_mask, dict" in inspect.getsource(forward)
    except (OSError, TypeError):
        return False


def tree_attention_masks(target: Target, tree: DraftTree) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask argument for a verify forward over ``tree``: one 4D float mask, or one per layer type."""
    implementation = getattr(target.model.config, "_attn_implementation", None)
    if implementation not in MASK_IMPLEMENTATIONS:
        raise ValueError(
            f"tree verification passes a custom 4D attention mask, which attn_implementation "
            f"{implementation!r} does not take; load the target with attn_implementation='sdpa' or 'eager'"
        )
    views = _layer_views(target.cache)
    masks = {view: additive_mask(tree_attention_mask(tree, *view), target.dtype) for view in set(views)}
    if len(masks) == 1:
        return next(iter(masks.values()))
    layer_types = getattr(target.config, "layer_types", None)
    if layer_types is None or not _takes_mask_mapping(type(target.model.get_decoder())):
        raise ValueError(
            f"{type(target.model).__name__} mixes full and sliding-window attention but takes a single "
            "attention mask, so a tree cannot be verified with the right mask in every layer; use chain "
            "drafting (no --tree) with this target"
        )
    by_type: dict[str, torch.Tensor] = {}
    for name, view in zip(layer_types, views):
        if by_type.setdefault(name, masks[view]) is not masks[view]:
            raise ValueError(
                f"layers of type {name!r} differ in sliding window; tree verification cannot give them one mask"
            )
    return by_type


@torch.inference_mode()
def tree_forward(target: Target, tree: DraftTree) -> TargetStep:
    """Run the target over every node of ``tree`` after its cached prefix; logits [N + 1, V] and features."""
    if target.cache is None:
        raise RuntimeError("tree_forward needs a prefilled target (run target.forward over the prompt first)")
    return target.forward(
        tree.tokens, tree_position_ids(tree, target.length), tree_attention_masks(target, tree)
    )


@torch.inference_mode()
def compact_cache(cache: DynamicCache, appended: int, keep: torch.Tensor) -> None:
    """Keep only ``keep`` (ascending indices) of the last ``appended`` positions in every cache layer.

    After a tree forward the tree's nodes are the last entries of every layer; keeping the root and the
    accepted path leaves one contiguous sequence, each key already rotated for its final position.
    """
    _layer_views(cache)  # refuses cache layers this cannot compact
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys is None:
            continue
        start = layer.keys.shape[-2] - appended
        idx = keep.to(layer.keys.device) + start
        end = start + idx.numel()
        layer.keys[..., start:end, :] = layer.keys[..., idx, :]
        layer.values[..., start:end, :] = layer.values[..., idx, :]
        layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        if type(layer) is DynamicSlidingWindowLayer:
            layer.cumulative_length -= appended - idx.numel()
            if layer.cumulative_length >= layer.sliding_window:  # as crop does: the window's last W - 1
                layer.keys = layer.keys[..., -layer.sliding_window + 1 :, :]
                layer.values = layer.values[..., -layer.sliding_window + 1 :, :]


@torch.inference_mode()
def generate_tree(
    target: Target,
    prompt: torch.Tensor,
    drafter: Drafter,
    tree: TreeSpec | TreeBudget,
    max_new_tokens: int = 256,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate up to max_new_tokens after prompt [S] with tree drafting; stop after an EOS token.

    ``tree``: a fixed shape, or a ``TreeBudget`` that picks the node budget per step from measured
    tokens/s (budget 0 = a plain decoding step). ``result.chosen_k`` lists each step's node budget
    (0 for a plain step).
    ``result.proposed[i]`` is the depth of step i's tree (the most tokens it could accept), so α and
    the per-position rates read as for a chain of that length.
    """
    policy = tree if isinstance(tree, TreeBudget) else None
    if policy is not None:
        tree = TreeSpec(policy.depth, policy.top_k, max(policy.budgets[-1], 1))
    if not drafter.supports_tree:
        drafter.propose_tree(prompt, tree, sampling, generator)  # raises the drafter's own clear error
    device = target.device
    prompt = prompt.to(device).view(-1)
    target.check_fits(prompt.shape[0], max_new_tokens)
    target.reset()
    target.set_capture(drafter.capture_layers)

    sync(device)
    start = time.perf_counter()
    step = target.forward(prompt)
    last = step.logits[-1]
    first = int(last.argmax(-1)) if sampling.greedy else int(sample(to_probs(last, sampling), generator))
    drafter.begin(prompt, step.features)
    sync(device)
    result = GenerationResult(tokens=[first], target_forwards=1)
    result.prefill_seconds = time.perf_counter() - start
    tokens = torch.cat([prompt, torch.tensor([first], device=device)])

    while first not in target.eos_ids and len(result.tokens) < max_new_tokens:
        budget = policy.choose() if policy is not None else tree.total_tokens
        depth = min(tree.depth, max_new_tokens - len(result.tokens) - 1)  # never draft past the budget
        depth = depth if budget > 0 else 0
        t0 = time.perf_counter()
        if depth > 0:
            draft = drafter.propose_tree(tokens, TreeSpec(depth, tree.top_k, budget), sampling, generator)
        else:
            draft = DraftTree.chain(int(tokens[-1]), [], device)
        sync(device)
        t1 = time.perf_counter()
        if draft.tokens.device != device:
            draft = DraftTree(draft.tokens.to(device), draft.parents.to(device))
        # a tree with no draft nodes (a plain step, or the last token) takes the plain path: no 4-D mask
        step = tree_forward(target, draft) if len(draft) > 1 else target.forward(draft.tokens)
        if sampling.greedy:
            path, nxt = verify_tree_greedy(draft, step.logits)
        else:
            path, nxt = verify_tree_sampled(draft, to_probs(step.logits, sampling), generator)
        if len(draft) > 1:
            keep = torch.tensor([0, *path], device=device)
            compact_cache(target.cache, len(draft), keep)
            feats = {i: f[keep] for i, f in step.features.items()} if step.features else None
        else:  # a plain step: the cache already holds just the root, and its features are the only ones
            feats = step.features
        drafter.commit_tree(path, feats)
        sync(device)
        t2 = time.perf_counter()
        result.record_step(len(path), draft.depth, budget if depth > 0 else 0, t1 - t0, t2 - t1)
        if policy is not None and (depth == tree.depth or budget == 0):  # a tree cut short says little
            policy.record(budget, len(path) + 1, t2 - t0)

        tokens = commit_tokens(result, tokens, draft.tokens[path].tolist() + [nxt], target.eos_ids)
        if result.stopped_by == "eos":
            break
    return result.finish(first, target.eos_ids, device, start)
