"""Timed decoding of prompts that are already token ids, for benchmarks that go past ``evaluate``.

``evaluate`` (eval/harness.py) is the measurement of drafts on chat prompts. Some benchmarks decode
token ids instead (first turns only, random ids for a random target), in batches, or beside decoders
that are not draftsmith's. They run here, timed by the decoders themselves where they can be (the
device drained), and what they did is kept in eval/stats' records, so no benchmark counts steps or
derives τ itself:

- ``decode_each``: one prompt after another through the shared decoder (``decode.speculative.generate``);
- ``decode_batched``: ``size`` prompts at a time through ``decode.batched.generate_batch``;
- ``side_by_side``: any decoders (``transformers_decoder``, ``draftsmith_decoder``), warmed up, then
  interleaved prompt by prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from draftsmith.decode.batched import generate_batch
from draftsmith.decode.drafter import Drafter
from draftsmith.decode.speculative import KPolicy, generate
from draftsmith.decode.target import Target
from draftsmith.eval.harness import balanced_order
from draftsmith.eval.stats import AcceptanceStats, RunStats, Timing

Decoder = Callable[[torch.Tensor, int], list[int]]
"""(prompt token ids [S], max new tokens) -> the new tokens."""


@dataclass
class Decoded:
    """What a run over some prompts did: eval/stats' record and each prompt's new tokens."""

    stats: RunStats = field(default_factory=RunStats)
    outputs: list[list[int]] = field(default_factory=list)

    def same_as(self, reference: Sequence[list[int]]) -> int:
        """How many outputs equal ``reference``'s, prompt by prompt."""
        return same_outputs(self.outputs, reference)


def same_outputs(outputs: Sequence[list[int]], reference: Sequence[list[int]]) -> int:
    """How many of ``outputs`` equal ``reference``'s, prompt by prompt."""
    return sum(a == b for a, b in zip(outputs, reference))


def decode_each(
    target: Target, prompts: Sequence[torch.Tensor], drafter: Drafter | None, k: KPolicy, max_new_tokens: int
) -> Decoded:
    """``prompts`` decoded one after another, greedy (``k`` ignored without a drafter)."""
    run = Decoded()
    for ids in prompts:
        result = generate(target, ids, drafter, k=k, max_new_tokens=max_new_tokens)
        run.stats = run.stats + RunStats.from_result(result)
        run.outputs.append(result.tokens)
    return run


def decode_batched(
    target: Target,
    prompts: Sequence[torch.Tensor],
    drafter: Drafter | None,
    k: int,
    size: int,
    max_new_tokens: int,
) -> Decoded:
    """``prompts`` decoded ``size`` at a time by ``generate_batch``, greedy. Acceptance per sequence;
    timing per batch (``target_forwards`` counts batched passes)."""
    run = Decoded()
    for lo in range(0, len(prompts), size):
        out = generate_batch(target, prompts[lo : lo + size], drafter, k, max_new_tokens)
        acceptance = sum((AcceptanceStats.from_result(s) for s in out.sequences), AcceptanceStats())
        timing = Timing(
            generations=len(out.sequences),
            new_tokens=out.new_tokens,
            seconds=out.seconds,
            prefill_seconds=out.prefill_seconds,
            target_forwards=out.target_forwards,
        )
        run.stats = run.stats + RunStats(acceptance, timing)
        run.outputs += [s.tokens for s in out.sequences]
    return run


def batched_row(
    target: Target,
    prompts: Sequence[torch.Tensor],
    reference: Sequence[list[int]],
    drafter: Drafter | None,
    k: int,
    size: int,
    max_new_tokens: int,
) -> dict:
    """``decode_batched`` as a benchmark's JSON row: tokens/s, τ, batched forwards, and how many outputs
    equal ``reference`` (the target alone, one prompt at a time)."""
    run = decode_batched(target, prompts, drafter, k, size, max_new_tokens)
    timing, acceptance = run.stats.timing, run.stats.acceptance
    return {
        "batch_size": size,
        "tokens": timing.new_tokens,
        "seconds": timing.seconds,
        "tokens_per_s": timing.tokens_per_s,
        "tau": acceptance.tau,
        "batched_forwards": timing.target_forwards,
        "exact": run.same_as(reference),
        "prompts": len(prompts),
    }


def transformers_decoder(target: Target, **generate_kwargs) -> Decoder:
    """transformers' own ``generate`` on the target's model, greedy, stopping at the target's EOS tokens;
    ``generate_kwargs`` picks its speculative path (``prompt_lookup_num_tokens``, ``assistant_model``)."""
    eos = sorted(target.eos_ids)

    def run(prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
        ids = prompt.view(1, -1).to(target.device)
        out = target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **generate_kwargs,
        )
        return out[0, ids.shape[1] :].tolist()

    return run


def draftsmith_decoder(target: Target, drafter: Drafter | None, k: KPolicy) -> Decoder:
    """The shared decoder; ``k`` fixed, or a ``CostModel`` kept across prompts (k = "auto")."""

    def run(prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
        return generate(target, prompt, drafter, k=k, max_new_tokens=max_new_tokens).tokens

    return run


WARMUP_TOKENS = 16
"""New tokens of each decoder's warm-up generation."""


def side_by_side(
    decoders: dict[str, Decoder], warmup: torch.Tensor, prompts: Sequence[torch.Tensor], max_new_tokens: int
) -> dict[str, dict]:
    """Every decoder warmed up on ``warmup``, then timed over ``prompts`` interleaved (all decoders on
    prompt 1, then on prompt 2, ...), in ``balanced_order``: a run's speed depends on what ran just before
    it (caches, the allocator, the CPU's clocks, what a server left running), so a fixed order favours some
    decoders; on a CPU two runs of identical code differed by 26 % in tokens/s from their places alone, and
    under a plain rotation the decoder that always ran right after vLLM's server read 24 % slower. Per decoder:
    tokens, seconds, tokens/s, its outputs, and how many equal the first decoder's. Wall time per call: the
    new tokens come back as Python ints, so the device has finished by then."""
    for run in decoders.values():
        run(warmup, WARMUP_TOKENS)
    rows = {name: {"tokens": 0, "seconds": 0.0, "outputs": []} for name in decoders}
    names = list(decoders)
    for i, prompt in enumerate(prompts):
        for name in (names[j] for j in balanced_order(len(names), i)):
            run = decoders[name]
            start = time.perf_counter()
            out = run(prompt, max_new_tokens)
            rows[name]["seconds"] += time.perf_counter() - start
            rows[name]["tokens"] += len(out)
            rows[name]["outputs"].append(out)
    reference = next(iter(rows.values()))["outputs"]
    for row in rows.values():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["same_as_first"] = same_outputs(row["outputs"], reference)
    return rows
