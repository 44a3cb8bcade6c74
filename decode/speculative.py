"""The shared speculative decoder (chain drafting, batch size 1).

One loop serves every drafter and the plain autoregressive baseline (``drafter=None`` or
``k=0``): each step drafts up to k tokens, runs the target once over ``[last token] + drafts``,
keeps the accepted prefix plus one target token, and rolls both KV caches back to the accepted
length. The prefix is never recomputed. ``k="auto"`` (or a ``CostModel``) picks k per step from
measured acceptance and costs (``decode/cost_model.py``); ``k = 0`` steps are plain decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftsmith.decode.cost_model import CostModel
from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.decode.target import Target
from draftsmith.decode.verify import verify_greedy, verify_sampled


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
    chosen_k: list[int] = field(default_factory=list)
    """The k asked of the drafter at each verify step (fixed, or the cost model's pick), capped by the
    budget; for tree decoding, each step's node budget (0 = a plain step)."""

    def record_step(self, accepted: int, proposed: int, chosen: int, draft_s: float, verify_s: float) -> None:
        """One verify step: its counts and where its time went."""
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s
        self.target_forwards += 1
        self.accepted.append(accepted)
        self.proposed.append(proposed)
        self.chosen_k.append(chosen)

    def finish(self, first: int, eos_ids, device: torch.device, start: float) -> GenerationResult:
        """Close the generation: EOS as the very first token, the device drained, the wall time."""
        if first in eos_ids:
            self.stopped_by = "eos"
        sync(device)
        self.seconds = time.perf_counter() - start
        return self


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so wall-clock timings are real; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The target's token from its logits [V]: the argmax when greedy, else drawn under ``sampling``."""
    if sampling.greedy:
        return int(logits.argmax(-1))
    return int(sample(to_probs(logits, sampling), generator))


GREEDY = Sampling()
KPolicy = int | str | CostModel
"""A fixed k (0 = plain decoding), ``"auto"`` (a fresh CostModel per call) or a CostModel kept across calls."""


def resolve_k(k: KPolicy) -> tuple[int, CostModel | None]:
    """(fixed k, None) or (0, the cost model that chooses k per step)."""
    if isinstance(k, CostModel):
        return 0, k
    if k == "auto":
        return 0, CostModel()
    if isinstance(k, int) and not isinstance(k, bool) and k >= 0:
        return k, None
    raise ValueError(f"k must be an integer >= 0, 'auto' or a CostModel, got {k!r}")


@torch.inference_mode()
def commit_tokens(result: GenerationResult, tokens: torch.Tensor, new: list[int], eos_ids) -> torch.Tensor:
    """Append a step's accepted tokens (cut after the first EOS, which ends the generation) to
    ``result`` and to the committed ``tokens``; returns the new committed tokens."""
    for pos, tok in enumerate(new):
        if tok in eos_ids:
            new = new[: pos + 1]
            result.stopped_by = "eos"
            break
    result.tokens.extend(new)
    return torch.cat([tokens, torch.tensor(new, device=tokens.device)])


def generate(
    target: Target,
    prompt: torch.Tensor,
    drafter: Drafter | None = None,
    k: KPolicy = 5,
    max_new_tokens: int = 256,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Generate up to max_new_tokens after prompt [S] (token ids); stop after an EOS token.

    ``k``: draft tokens per step, ``"auto"`` or a CostModel (see ``resolve_k``); ignored without a drafter.
    """
    k, policy = resolve_k(k)
    if drafter is None:
        k, policy = 0, None
    device = target.device
    prompt = prompt.to(device).view(-1)
    target.check_fits(prompt.shape[0], max_new_tokens)
    target.reset()
    target.set_capture(drafter.capture_layers if drafter is not None else ())

    sync(device)
    start = time.perf_counter()
    step = target.forward(prompt)
    first = pick_token(step.logits[-1], sampling, generator)
    if drafter is not None:
        drafter.begin(prompt, step.features)
    sync(device)
    result = GenerationResult(tokens=[first], target_forwards=1)
    result.prefill_seconds = time.perf_counter() - start
    tokens = torch.cat([prompt, torch.tensor([first], device=device)])
    empty = Proposal(torch.empty(0, dtype=torch.long, device=device))

    while first not in target.eos_ids and len(result.tokens) < max_new_tokens:
        budget = max_new_tokens - len(result.tokens)
        t0 = time.perf_counter()
        # never draft past the budget: at most `budget` tokens (drafts + 1) may be committed
        k_step = min(policy.choose() if policy is not None else k, budget - 1)
        proposal = drafter.propose(tokens, k_step, sampling, generator) if drafter else empty
        sync(device)
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
        sync(device)
        t2 = time.perf_counter()
        result.record_step(n, len(drafted), k_step, t1 - t0, t2 - t1)
        if policy is not None:
            policy.record(k_step, len(drafted), n, t1 - t0, t2 - t1)

        tokens = commit_tokens(result, tokens, drafted[:n].tolist() + [nxt], target.eos_ids)
        if result.stopped_by == "eos":
            break
    return result.finish(first, target.eos_ids, device, start)
