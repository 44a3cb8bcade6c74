"""On-policy data for distillation (DistillSpec's mixture): the draft's own continuations of a batch's
prompts replace a fraction of its rows, to be scored by the target like any other row."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache

from draftsmith.decode.sampling import Sampling, sample, to_probs
from draftsmith.decode.target import Target
from draftsmith.train.corpus.tokens import collate, pad_id_of
from draftsmith.train.objective import Batch


def prompt_prefixes(batch: Batch) -> list[torch.Tensor]:
    """Each row's tokens before its first assistant token (the whole row if it has none).

    The draft continues from there; later turns of a multi-turn row are dropped.
    """
    prefixes = []
    for ids, real, learn in zip(batch.input_ids, batch.attention_mask.bool(), batch.loss_mask.bool()):
        starts = torch.nonzero(learn & real).flatten()
        end = int(starts[0]) if starts.numel() else int(real.sum())
        prefixes.append(ids[real][:end])
    return prefixes


@torch.no_grad()
def sample_on_policy(
    draft: nn.Module,
    target: Target,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> Batch:
    """The draft's own continuations (up to EOS or max_new_tokens) of each prompt, batched.

    Returns a right-padded Batch: prompt tokens (loss_mask 0) then the sampled tokens (loss_mask 1),
    ready for the loop to score with the target. ``temperature`` 0 samples greedily.
    """
    if not prompts or max_new_tokens < 1:
        raise ValueError(
            f"need at least one prompt and max_new_tokens >= 1 (got {len(prompts)}, {max_new_tokens})"
        )
    if any(p.numel() == 0 for p in prompts):
        raise ValueError("an on-policy prompt is empty: every prompt needs at least one token")
    device = next(draft.parameters()).device
    pad = pad_id_of(target.tokenizer)
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    for b, p in enumerate(prompts):  # left padding: every row's next token is at the same column
        ids[b, width - p.numel() :] = p.to(device)
        attn[b, width - p.numel() :] = 1
    positions = (attn.cumsum(-1) - 1).clamp_min(0)
    eos = torch.tensor(sorted(target.eos_ids), dtype=torch.long, device=device)
    sampling = Sampling(temperature=temperature)
    was_training = draft.training
    draft.eval()
    try:
        cache = DynamicCache(config=draft.config)
        out = draft(input_ids=ids, attention_mask=attn, position_ids=positions, cache=cache, use_cache=True)
        finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        new: list[torch.Tensor] = []
        for step in range(max_new_tokens):
            logits = out.logits[:, -1].float()
            tok = logits.argmax(-1) if sampling.greedy else sample(to_probs(logits, sampling), generator)
            tok = torch.where(finished, pad, tok)
            new.append(tok)
            finished |= torch.isin(tok, eos)
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = draft(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=positions,
                cache=cache,
                use_cache=True,
            )
    finally:
        draft.train(was_training)
    generated = torch.stack(new, dim=1).cpu()
    rows = []
    for p, g in zip(prompts, generated):
        stops = torch.nonzero(torch.isin(g, eos.cpu())).flatten()
        g = g[: int(stops[0]) + 1] if stops.numel() else g
        rows.append(
            {
                "input_ids": torch.cat([p.cpu(), g]),
                "loss_mask": torch.cat([torch.zeros_like(p.cpu()), torch.ones_like(g)]),
            }
        )
    return collate(rows, pad)


def on_policy_rows(
    batch_size: int, fraction: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Which rows to replace: ``fraction`` of them in expectation (stochastic rounding), at random."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"on-policy fraction must be in [0, 1], got {fraction}")
    device = generator.device if generator is not None else "cpu"
    whole = math.floor(batch_size * fraction)
    extra = int(torch.rand((), generator=generator, device=device) < batch_size * fraction - whole)
    return torch.randperm(batch_size, generator=generator, device=device)[: whole + extra].sort().values.cpu()


def mix_on_policy(
    batch: Batch,
    draft: nn.Module,
    target: Target,
    fraction: float,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> Batch:
    """``batch`` with a ``fraction`` of its rows replaced by the draft's continuations of their prompts.

    DistillSpec's mixture of fixed and draft-generated data: 0 keeps the fixed data, 1 is fully
    on-policy. Replaced rows keep their place; the result is re-padded to its longest row. Rows must
    be whole conversations, not packed sequences (the prompt is found from the first assistant token).
    """
    if getattr(batch, "position_ids", None) is not None:
        raise ValueError("on-policy mixing needs unpacked rows (one conversation per row); turn packing off")
    chosen = on_policy_rows(batch.input_ids.shape[0], fraction, generator).tolist()
    if not chosen:
        return batch
    prefixes = prompt_prefixes(batch)
    fresh = sample_on_policy(
        draft, target, [prefixes[i] for i in chosen], max_new_tokens, temperature, generator
    )
    replaced = dict(zip(chosen, range(len(chosen))))
    rows = []
    for b in range(batch.input_ids.shape[0]):
        source, r = (fresh, replaced[b]) if b in replaced else (batch, b)
        real = source.attention_mask[r].bool()
        rows.append({"input_ids": source.input_ids[r][real], "loss_mask": source.loss_mask[r][real]})
    return collate(rows, pad_id_of(target.tokenizer))
