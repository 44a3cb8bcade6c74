"""Mirror speculative decoding (Mirror-SD, arXiv 2510.13161) on one device, lossless.

The target's forward is split at an early-exit layer ℓe: the target's own final norm and LM head read
that layer's output as next-token logits (the logit lens), and their top-κ tokens are what the target
would send a draft on another device while it computes layers ℓe+1…N. Per verify step:

1. the target runs once over ``[last token] + d_1..d_n`` (the proposal); a hook on layer ℓe marks where
   the forward is split, so its two parts are timed, and captures the layer's output h;
2. at every verify position j = 0..n (the token after d_j, had the target stopped there), the top-κ
   early-exit candidates;
3. the mirror draft (``drafts/mirror.py``: an EAGLE-3-shaped head on h) rolls out γ tokens after each
   candidate: the hypothesis grid, (n + 1)·κ branches drafted together;
4. the verify rule (``decode/verify.py``, unchanged) keeps n_acc drafts and picks the correction x*;
5. ``reuse_branch``: the branch at depth n_acc whose root is x* — if the early exit named x* — is the
   next step's proposal, and drafting costs nothing; otherwise the draft drafts γ tokens afresh.

Every proposal still goes through the ordinary verify rule with the distribution it was drawn from, so
greedy output is the target's own token for token and sampled output keeps the target's distribution.

On two devices, step 3 runs while the target computes layers after ℓe; on one it runs after them. The
result records each part's time per step, so ``two_device_seconds`` can model the overlap — a model,
labelled as one (docs/DECODING.md, "Mirror decoding"), never a measurement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.decode.features import decoder_layers, final_norm, resolve_layer_ids
from draftsmith.decode.sampling import Sampling, to_probs
from draftsmith.decode.speculative import GREEDY, GenerationResult, commit_tokens, pick_token, sync
from draftsmith.decode.target import Target
from draftsmith.decode.verify import verify_greedy, verify_sampled

PARTS = ("fresh_draft", "target_prefix", "early_exit", "target_suffix", "rollouts", "verify")
"""Where a mirror step's time goes, in order (seconds per step in ``MirrorResult.parts``)."""


@dataclass
class Grid:
    """The hypothesis grid of one step: branch r starts after verify position ``depths[r]`` with the
    early-exit candidate ``roots[r]`` and continues with the drafted ``tokens[r]`` [γ] (target ids).
    ``probs[r]`` [γ, Vd] are the distributions they were drawn from (None when greedy), over the draft's
    vocabulary, whose id i is target id ``vocab_map[i]`` (None: the target's own vocabulary)."""

    depths: torch.Tensor
    roots: torch.Tensor
    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    vocab_map: torch.Tensor | None = None
    vocab_size: int = 0

    def proposal(self, r: int) -> Proposal:
        """Branch r as the next step's proposal, its distributions over the target's vocabulary."""
        if self.probs is None:
            return Proposal(self.tokens[r])
        q = self.probs[r]
        if self.vocab_map is not None:
            q = q.new_zeros(q.shape[0], self.vocab_size).index_copy_(1, self.vocab_map, q)
        return Proposal(self.tokens[r], q)


def reuse_branch(grid: Grid, n_accepted: int, correction: int) -> int | None:
    """The branch to keep for the next step: its prefix is the accepted tokens (it starts at depth
    ``n_accepted``) and its root is the target's correction; None when the early exit missed it."""
    hit = ((grid.depths == n_accepted) & (grid.roots == correction)).nonzero()
    return int(hit[0, 0]) if hit.numel() else None


@dataclass(frozen=True)
class MirrorSettings:
    """What a mirror draft was trained with: the early-exit layer it reads (0-based output, as in
    ``decode/features.py``), early-exit candidates per position (κ) and tokens per branch (γ)."""

    early_exit_layer: int
    kappa: int
    gamma: int

    def __post_init__(self) -> None:
        if self.kappa < 1 or self.gamma < 1:
            raise ValueError(
                f"mirror decoding needs kappa >= 1 (early-exit candidates per position) and gamma >= 1 (tokens "
                f"per branch), got kappa={self.kappa}, gamma={self.gamma}"
            )


@runtime_checkable
class GridDrafter(Protocol):
    """A drafter that offers mirror decoding (``drafts/mirror.py``'s): a ``Drafter`` that also knows the
    settings it was trained with and drafts the hypothesis grid. ``isinstance(drafter, GridDrafter)``
    asks a drafter whether it offers the mode, as ``supports_tree`` and ``batched()`` ask for theirs."""

    mirror: MirrorSettings
    """The early-exit layer, κ and γ the draft was trained with."""

    def rollout(
        self,
        tokens: torch.Tensor,
        drafted: torch.Tensor,
        exit_hidden: torch.Tensor,
        candidates: torch.Tensor,
        gamma: int,
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> Grid:
        """The hypothesis grid: ``gamma`` draft tokens after every candidate. ``candidates`` [n + 1, κ] are
        target ids at the verify positions of ``[tokens[-1]] + drafted`` (n tokens), whose early-exit
        layer outputs are ``exit_hidden`` [n + 1, H]. Leaves the drafter's committed state as it was."""


@dataclass
class MirrorResult(GenerationResult):
    """A generation by ``generate_mirror``: the usual counts plus each step's parts and the grid's hits."""

    parts: list[tuple[float, ...]] = field(default_factory=list)
    """Per verify step, seconds spent in each of ``PARTS``."""
    hits: int = 0
    """Steps whose proposal was a reused branch of the previous step's grid."""
    reuse_chances: int = 0
    """Steps that had a previous step's grid to reuse from (every step but the first)."""

    def overlapped_seconds(self) -> float:
        """The prefill plus, per step, fresh drafting + target up to ℓe + the early-exit LM head +
        max(target after ℓe, rollouts) + verify: the steps' critical path were the rollouts on a second
        device, overlapping the target's layers after ℓe. A fresh draft after a miss does not overlap,
        and the early-exit head (the target's own LM head, on its device) is on the path.
        ``two_device_seconds`` adds the channel; both are MODELS built from measured parts."""
        total = self.prefill_seconds
        for fresh, prefix, early_exit, suffix, rollouts, verify in self.parts:
            total += fresh + prefix + early_exit + max(suffix, rollouts) + verify
        return total

    def two_device_seconds(self, channel_latency: float) -> float:
        """MODELLED wall time on two devices: ``overlapped_seconds`` plus ``channel_latency`` seconds per
        step (the early-exit candidates to the draft and its branches back)."""
        return self.overlapped_seconds() + channel_latency * len(self.parts)


class ExitTimer:
    """Times the target's forward up to the end of decoder layer ℓe (a forward hook marks it)."""

    def __init__(self, model: torch.nn.Module, layer: int):
        self.device = next(model.parameters()).device
        self.mark = 0.0
        self.handle = decoder_layers(model)[layer].register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, _output) -> None:
        sync(self.device)
        self.mark = time.perf_counter()

    def close(self) -> None:
        self.handle.remove()


def check_mirror(target: Target, drafter: Drafter, settings: MirrorSettings | None) -> MirrorSettings:
    """The settings to decode with (``settings``, else the draft's own); clear errors for a drafter or
    settings mirror decoding cannot run with."""
    if not isinstance(drafter, GridDrafter):
        raise ValueError(
            f"{drafter.name!r} ({type(drafter).__name__}) is not a mirror draft; mirror decoding needs one trained "
            "on the target's early exit (draft.kind: mirror)"
        )
    settings = settings or drafter.mirror
    if settings.early_exit_layer != drafter.mirror.early_exit_layer:
        raise ValueError(
            f"the mirror draft {drafter.name!r} was trained on layer {drafter.mirror.early_exit_layer}'s outputs "
            f"and cannot draft from layer {settings.early_exit_layer}'s; train one with "
            f"draft.options.early_exit_layer={settings.early_exit_layer}"
        )
    resolve_layer_ids(target.model, [settings.early_exit_layer])  # inside the target's layers
    return settings


@torch.inference_mode()
def early_exit_candidates(target: Target, hidden: torch.Tensor, kappa: int) -> torch.Tensor:
    """Top-κ next-token ids [S, κ] that the target's final norm and LM head read from a layer's output."""
    model = target.model
    logits = model.get_output_embeddings()(final_norm(model)(hidden))
    return logits.topk(min(kappa, logits.shape[-1]), dim=-1).indices


def generate_mirror(
    target: Target,
    prompt: torch.Tensor,
    drafter: Drafter,
    settings: MirrorSettings | None = None,
    max_new_tokens: int = 256,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> MirrorResult:
    """Mirror decoding of up to ``max_new_tokens`` after ``prompt`` [S]. ``settings`` (κ, γ) default to the
    draft's own; the early-exit layer must be the one it was trained on."""
    settings = check_mirror(target, drafter, settings)
    device = target.device
    prompt = prompt.to(device).view(-1)
    target.check_fits(prompt.shape[0], max_new_tokens)
    target.reset()
    exit_layer = settings.early_exit_layer
    target.set_capture(tuple(sorted({exit_layer, *drafter.capture_layers})))
    timer = ExitTimer(target.model, exit_layer)
    try:
        return _decode(target, prompt, drafter, settings, max_new_tokens, sampling, generator, timer)
    finally:
        timer.close()


@torch.inference_mode()
def _decode(target, prompt, drafter, settings, max_new_tokens, sampling, generator, timer) -> MirrorResult:
    device, exit_layer = target.device, settings.early_exit_layer
    kappa, gamma = settings.kappa, settings.gamma
    sync(device)
    start = time.perf_counter()
    step = target.forward(prompt)
    first = pick_token(step.logits[-1], sampling, generator)
    drafter.begin(prompt, {i: step.features[i] for i in drafter.capture_layers})
    sync(device)
    result = MirrorResult(tokens=[first], target_forwards=1)
    result.prefill_seconds = time.perf_counter() - start
    tokens = torch.cat([prompt, torch.tensor([first], device=device)])
    reused: Proposal | None = None  # the branch the last step's grid kept for this one

    while first not in target.eos_ids and len(result.tokens) < max_new_tokens:
        budget = max_new_tokens - len(result.tokens)
        k_step = min(gamma, budget - 1)  # never draft past the budget
        t0 = time.perf_counter()
        result.reuse_chances += len(result.parts) > 0
        result.hits += reused is not None
        if reused is not None:
            proposal = Proposal(
                reused.tokens[:k_step], None if reused.probs is None else reused.probs[:k_step]
            )
        else:
            proposal = drafter.propose(tokens, k_step, sampling, generator)
        sync(device)
        t1 = time.perf_counter()
        drafted = proposal.tokens.to(device)
        step = target.forward(torch.cat([tokens[-1:], drafted]))
        sync(device)
        t2 = time.perf_counter()
        exit_hidden = step.features[exit_layer]
        candidates = early_exit_candidates(target, exit_hidden, kappa)
        sync(device)
        t_exit = time.perf_counter()
        grid = drafter.rollout(tokens, drafted, exit_hidden, candidates, gamma, sampling, generator)
        sync(device)
        t3 = time.perf_counter()
        if sampling.greedy:
            n, nxt = verify_greedy(drafted, step.logits)
        else:
            n, nxt = verify_sampled(drafted, proposal.probs, to_probs(step.logits, sampling), generator)
        target.rollback(tokens.shape[0] + n)
        drafter.commit(n, {i: f[: n + 1] for i, f in step.features.items() if i in drafter.capture_layers})
        r = reuse_branch(grid, n, nxt)
        if r is not None:
            nxt = int(grid.roots[r])  # the target's correction: reuse_branch matched them
            reused = grid.proposal(r)
        else:
            reused = None
        sync(device)
        t4 = time.perf_counter()
        # the hook fired inside the forward: [t1, mark] is the target up to ℓe, [mark, t2] the rest
        mark = min(max(timer.mark, t1), t2)
        result.record_step(n, len(drafted), k_step, t1 - t0, t4 - t1)
        result.parts.append((t1 - t0, mark - t1, t_exit - t2, t2 - mark, t3 - t_exit, t4 - t3))
        tokens = commit_tokens(result, tokens, drafted[:n].tolist() + [nxt], target.eos_ids)
        if result.stopped_by == "eos":
            break
    return result.finish(first, target.eos_ids, device, start)
