"""The shared speculative decoder (chain drafting, batch size 1).

One loop serves every drafter and the plain autoregressive baseline (``drafter=None`` or
``k=0``): each step drafts up to k tokens, runs the target once over ``[last token] + drafts``,
keeps the accepted prefix plus one target token, and rolls both KV caches back to the accepted
length. The prefix is never recomputed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.decode.target import Target
from draftsmith.decode.verify import verify_greedy, verify_sampled
from draftsmith.drafts.base import Drafter, Proposal


@dataclass
class GenerationResult:
    """What one generation did. ``accepted[i]`` / ``proposed[i]``: draft tokens kept / offered at verify step i."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    target_forwards: int = 0
    """Prefill included."""
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    seconds: float = 0.0
    stopped_by: str = "length"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    if sampling.greedy:
        return int(logits.argmax(-1))
    return int(sample(to_probs(logits, sampling), generator))


GREEDY = Sampling()


@torch.inference_mode()
def generate(
    target: Target,
    prompt: torch.Tensor,
    drafter: Drafter | None = None,
    k: int = 5,
    max_new_tokens: int = 256,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate up to max_new_tokens after prompt [S] (token ids); stop after an EOS token."""
    if drafter is None:
        k = 0
    device = target.device
    prompt = prompt.to(device).view(-1)
    target.reset()
    target.set_capture(drafter.capture_layers if drafter is not None else ())

    _sync(device)
    start = time.perf_counter()
    step = target.forward(prompt)
    first = _pick(step.logits[-1], sampling, generator)
    if drafter is not None:
        drafter.begin(prompt, step.features)
    _sync(device)
    result = GenerationResult(tokens=[first], target_forwards=1)
    result.prefill_seconds = time.perf_counter() - start
    tokens = torch.cat([prompt, torch.tensor([first], device=device)])
    empty = Proposal(torch.empty(0, dtype=torch.long, device=device))

    while first not in target.eos_ids and len(result.tokens) < max_new_tokens:
        budget = max_new_tokens - len(result.tokens)
        t0 = time.perf_counter()
        # never draft past the budget: at most `budget` tokens (drafts + 1) may be committed
        proposal = drafter.propose(tokens, min(k, budget - 1), sampling, generator) if drafter else empty
        _sync(device)
        t1 = time.perf_counter()
        drafted = proposal.tokens.to(device)
        step = target.forward(torch.cat([tokens[-1:], drafted]))
        if sampling.greedy:
            n, nxt = verify_greedy(drafted, step.logits)
        else:
            n, nxt = verify_sampled(drafted, proposal.probs, to_probs(step.logits, sampling), generator)
        target.rollback(tokens.shape[0] + n)  # cache keeps the accepted drafts; nxt is pending
        if drafter is not None:
            feats = {i: f[: n + 1] for i, f in step.features.items()} if step.features else None
            drafter.commit(n, feats)
        _sync(device)
        t2 = time.perf_counter()
        result.draft_seconds += t1 - t0
        result.verify_seconds += t2 - t1
        result.target_forwards += 1
        result.accepted.append(n)
        result.proposed.append(len(drafted))

        new = drafted[:n].tolist() + [nxt]
        for pos, tok in enumerate(new):
            if tok in target.eos_ids:
                new = new[: pos + 1]
                result.stopped_by = "eos"
                break
        result.tokens.extend(new)
        tokens = torch.cat([tokens, torch.tensor(new, device=device)])
        if result.stopped_by == "eos":
            break
    if first in target.eos_ids:
        result.stopped_by = "eos"
    _sync(device)
    result.seconds = time.perf_counter() - start
    return result
