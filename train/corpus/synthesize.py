"""Training prompts written by the target itself (Magpie-style self-synthesis).

An instruction-tuned model, given only the start of a user turn (its chat template up to where the
user's words go), writes a plausible user request and closes the turn. Sampling that many times gives
prompts in the target's own notion of what users ask — general instructions, questions, writing and
coding requests — with no prompt dataset at all. Answered by ``data regenerate``, they make training
text that is the target's from the first token to the last.

Only requests that end with an end-of-turn token within ``max_new_tokens`` are kept (a request that
runs on is usually the model drifting into an answer); empty or very short ones and exact duplicates
are dropped. Output: JSONL records ``{"id": "synthesized:<seed>:<n>", "messages": [user turn]}``, the
shape ``data prompts`` writes and ``data regenerate`` reads. Resumable: a rerun appends until
``count`` records are there; each batch is sampled from its own seed, so the records do not depend on
where a run was interrupted (on the CPU, where sampling is deterministic).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.loading import eos_token_ids
from draftsmith.train.corpus.generate import generate_replies
from draftsmith.train.corpus.prompts import read_done
from draftsmith.train.corpus.tokens import chat_text, check_chat_template

SENTINEL = "\u2063draftsmith-user-text\u2063"


@dataclass
class SynthesizeStats:
    """What one run did."""

    written: int = 0
    already_done: int = 0
    sampled: int = 0
    unfinished: int = 0
    """requests that hit max_new_tokens before an end-of-turn token (dropped)"""
    too_short: int = 0
    duplicates: int = 0


def user_turn_prefix(tokenizer, system: str | None = None) -> str:
    """The chat template's text up to where the user's first message goes (its default system prompt,
    if it adds one, included; ``system`` replaces it)."""
    check_chat_template(tokenizer)
    messages = [{"role": "system", "content": system}] if system else []
    text = chat_text(tokenizer, [*messages, {"role": "user", "content": SENTINEL}])
    at = text.find(SENTINEL)
    if at < 0:
        raise ValueError(
            "the chat template does not render the user's message verbatim, so there is no user-turn "
            "prefix to continue from; self-synthesis needs a template that does"
        )
    return text[:at]


def synthesize(
    model,
    tokenizer,
    out: str | Path,
    count: int,
    max_new_tokens: int = 128,
    batch_size: int = 32,
    temperature: float = 1.0,
    min_chars: int = 10,
    system: str | None = None,
    seed: int = 0,
    max_batches: int | None = None,
    progress: bool = True,
) -> SynthesizeStats:
    """Append self-synthesized user prompts to ``out`` until it holds ``count`` (see the module docstring).

    ``max_batches`` (default: enough for 4 samples per wanted prompt) stops a model that rarely
    finishes a request instead of sampling forever.
    """
    if count < 1 or batch_size < 1 or max_new_tokens < 1 or temperature <= 0:
        raise ValueError(
            f"count ({count}), batch_size ({batch_size}) and max_new_tokens ({max_new_tokens}) must be at "
            f"least 1 and temperature ({temperature}) above 0: synthesis samples"
        )
    eos = sorted(eos_token_ids(model, tokenizer))
    if not eos:
        raise ValueError("the target defines no end-of-sequence token, so a request would never end")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    prefix = tokenizer(user_turn_prefix(tokenizer, system), add_special_tokens=False)["input_ids"]

    out = Path(out)
    done = read_done(out, key="id")  # cuts a partial last line left by a kill
    seen = set()
    if done:
        for line in out.read_text(encoding="utf-8").splitlines():
            if line.strip():
                seen.add(json.loads(line)["messages"][0]["content"])
    stats = SynthesizeStats(already_done=len(done))
    if max_batches is None:
        max_batches = -(-4 * count // batch_size)
    mine = f"synthesized:{seed}:"
    # resume with the last batch a run wrote from (it may have been cut short); earlier ones are complete
    batch_index = max((int(i[len(mine) :].split(":")[0]) for i in done if i.startswith(mine)), default=0)
    written = len(done)
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        out.open("a", encoding="utf-8") as f,
        tqdm(total=count, initial=written, desc="synthesize", unit="prompt", disable=not progress) as bar,
    ):
        while written < count and batch_index < max_batches:
            torch.manual_seed(seed * 1_000_003 + batch_index)
            replies = generate_replies(model, [prefix] * batch_size, pad_id, eos, max_new_tokens, temperature)
            for n, (reply_ids, finished) in enumerate(replies):
                record_id = f"{mine}{batch_index}:{n}"
                if record_id in done:
                    continue
                stats.sampled += 1
                text = tokenizer.decode(reply_ids, skip_special_tokens=True).strip()
                if not finished:
                    stats.unfinished += 1
                elif len(text) < min_chars:
                    stats.too_short += 1
                elif text in seen:
                    stats.duplicates += 1
                elif written < count:
                    seen.add(text)
                    record = {"id": record_id, "messages": [{"role": "user", "content": text}]}
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
                    f.flush()
                    written += 1
                    stats.written += 1
                    bar.update(1)
            batch_index += 1
    return stats
