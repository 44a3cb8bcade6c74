"""Self-distillation data: the target writes the assistant replies to the training prompts.

A draft learns to predict what the target says, so training on the target's own replies (instead of
whatever model wrote the dataset) raises acceptance. For each conversation the system and user turns are
kept and every assistant turn is replaced by the target's reply to the conversation so far — earlier
replies included, so later user turns may no longer quite follow; a conversation that ends with a user
turn gets a reply too. The replies come from one of ``generate.py``'s engines (``batching="continuous"``
or ``"static"``); the default, ``"auto"``, is continuous on an accelerator and static on the CPU, where
the library's paged attention (without a flash kernel it attends over every request's keys, masked)
measured slower than padding (docs/studies/regeneration.md).

A reply that hits ``max_new_tokens`` is flagged: ``truncated_replies`` counts them and ``cut_replies`` lists
their message indices. Every token of such a reply is the target's own, but the end of turn the chat template
puts after it never was, so training learns the reply and not that ending (``tokens.render``). A reasoning
model's reply that stops inside its ``<think>`` block is listed in ``cut_thinking`` too. ``reasoning="strip"``
saves replies without their thinking block, ``"keep"`` as the target wrote them.

Tool results (role ``tool``) are kept as context, and so are assistant messages that call tools: the results
after them answer those calls, which another reply would not have made.

The output is JSONL in the ``messages`` shape with a ``source_id`` ("file name:record index"). Records
are appended and flushed one by one, so a rerun skips what is there and a killed run loses at most the
batch in flight; a partial last line left by a kill is cut off on resume.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.loading import eos_token_ids
from draftsmith.train.corpus.conversations import Message, with_system
from draftsmith.train.corpus.generate import (
    batching_config,
    generate_replies,
    generation_config,
    run_continuous,
)
from draftsmith.train.corpus.prompts import read_done, source_conversations, take_shard
from draftsmith.train.corpus.tokens import chat_text, check_chat_template

REASONING = ("keep", "strip")
"""What ``regenerate`` saves of a reasoning model's ``<think>`` block: all of it, or none."""
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

BATCHING = ("auto", "continuous", "static")
"""``regenerate``'s ``batching`` choices: ``auto`` picks continuous on an accelerator, static on the CPU."""


@dataclass
class RegenerateStats:
    """What one run did."""

    written: int = 0
    already_done: int = 0
    replies: int = 0
    tokens: int = 0
    """tokens the target generated, end-of-turn tokens included"""
    truncated_replies: int = 0
    """replies that hit max_new_tokens before an end-of-turn token"""
    cut_conversations: int = 0
    """conversations stopped early because the prompt outgrew max_prompt_tokens"""
    left_for_later: int = 0
    """conversations not started because ``max_seconds`` ran out (a rerun does them)"""
    refused: int = 0
    """conversations left out because a server refused a request of theirs (HTTP 4xx; see ``served.py``)"""


def thinking_left_open(reply: str) -> bool:
    """The reply opens a thinking block and never closes it: it was cut while thinking."""
    return reply.lstrip().startswith(THINK_OPEN) and THINK_CLOSE not in reply


def strip_thinking(reply: str) -> str:
    """The reply without its thinking block: the answer after ``</think>``, or nothing when the thinking
    was never closed. A block opened by the generation prompt (no ``<think>`` in the reply) counts too."""
    if thinking_left_open(reply):
        return ""
    head, closed, answer = reply.partition(THINK_CLOSE)
    if not closed or (THINK_OPEN in head and not head.lstrip().startswith(THINK_OPEN)):
        return reply  # no thinking block, or a "<think>" that is part of the answer
    return answer.lstrip()


class Dialogue:
    """One conversation being rewritten: walks the source turns, asks for a reply where one is due.

    ``system`` is put first when the conversation has no system message; ``template_args`` go to the chat
    template; ``reasoning`` (``REASONING``) says what of a reply's thinking is saved."""

    def __init__(
        self,
        source_id: str,
        source: list[Message],
        reasoning: str = "keep",
        system: str | None = None,
        template_args: dict | None = None,
    ):
        if reasoning not in REASONING:
            raise ValueError(f"reasoning {reasoning!r}: choose one of {', '.join(REASONING)}")
        self.source_id = source_id
        self.source = with_system(source, system)
        self.reasoning, self.template_args = reasoning, template_args
        self.pos = 0
        self.out: list[Message] = []
        self.done = False
        self.cut_replies: list[int] = []
        self.cut_thinking: list[int] = []
        self.cut = False

    def next_prompt(self) -> list[Message] | None:
        """Copy system/user turns up to the next reply that is due; the messages to answer, or None."""
        if self.done:
            return None
        while self.pos < len(self.source):
            message = self.source[self.pos]
            self.pos += 1
            if message["role"] != "assistant" or message.get("tool_calls"):
                self.out.append(dict(message))  # context; a tool call is kept for the results that follow it
            elif self.out and self.out[-1]["role"] != "assistant":
                return self.out  # further assistant turns in a row are replaced by this one reply
        self.done = True
        return self.out if self.out and self.out[-1]["role"] in ("user", "tool") else None

    def answer(self, reply: str, finished: bool) -> None:
        if not finished:
            self.cut_replies.append(len(self.out))
        if thinking_left_open(reply):
            self.cut_thinking.append(len(self.out))
        if self.reasoning == "strip":
            reply = strip_thinking(reply)
        self.out.append({"role": "assistant", "content": reply})

    def next_ids(self, tokenizer, max_prompt_tokens: int | None) -> list[int] | None:
        """The token ids of the next prompt (rendered with the chat template, generation prompt added), or
        None once the dialogue is done: over, or stopped because its prompt outgrew ``max_prompt_tokens``."""
        while (messages := self.next_prompt()) is not None:
            text = chat_text(
                tokenizer, messages, add_generation_prompt=True, template_args=self.template_args
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
                return ids
            self.stop()
        return None

    def stop(self) -> None:
        """The prompt is too long: keep the conversation up to its last reply and end it."""
        last = max((i for i, m in enumerate(self.out) if m["role"] == "assistant"), default=None)
        if last is not None:
            del self.out[last + 1 :]
        self.done = self.cut = True

    def record(self, generator: dict | None = None) -> dict:
        """The output line: the conversation, its flags, and what wrote the replies (``generator``)."""
        rec: dict = {"source_id": self.source_id, "messages": self.out}
        if self.cut_replies:
            rec["truncated_replies"] = len(self.cut_replies)
            rec["cut_replies"] = self.cut_replies
        if self.cut_thinking:
            rec["cut_thinking"] = self.cut_thinking
        if self.cut:
            rec["prompt_too_long"] = True
        if generator:
            rec["generator"] = generator
        return rec


def regenerate(
    model,
    tokenizer,
    paths: Sequence[str | Path],
    out: str | Path,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    temperature: float = 0.0,
    limit: int | None = None,
    max_prompt_tokens: int | None = None,
    seed: int = 0,
    progress: bool = True,
    batching: str = "auto",
    max_seconds: float | None = None,
    shard: tuple[int, int] | None = None,
    generator: dict | None = None,
    reasoning: str = "keep",
    system: str | None = None,
    template_args: dict | None = None,
) -> RegenerateStats:
    """Rewrite the assistant turns of the conversations in ``paths`` with ``model``; append to ``out``.

    ``max_prompt_tokens`` (default: the model's context length minus max_new_tokens) stops a conversation
    whose prompt grows past it, keeping the turns already answered. temperature 0 is greedy decoding.
    ``batch_size``: conversations in flight at once; ``batching``: ``auto``, ``continuous`` or ``static``.
    ``max_seconds``: start no conversation after this long (those in flight finish); a rerun resumes.
    ``shard=(i, n)``: only the i-th of n disjoint shards of the input (``prompts.take_shard``).
    ``generator`` (engine, weights) is written into every record. ``reasoning``, ``system`` and
    ``template_args``: see ``Dialogue``.
    """
    if batching not in BATCHING:
        raise ValueError(f"batching {batching!r}: choose one of {', '.join(BATCHING)}")
    if batching == "auto":
        batching = "static" if model.device.type == "cpu" else "continuous"
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(
            f"batch_size ({batch_size}) and max_new_tokens ({max_new_tokens}) must be at least 1"
        )
    check_chat_template(tokenizer)
    eos = sorted(eos_token_ids(model, tokenizer))
    if not eos:
        raise ValueError("the target defines no end-of-sequence token, so replies would never stop")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    if max_prompt_tokens is None:
        context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        max_prompt_tokens = context - max_new_tokens if context else None
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context"
        )
    torch.manual_seed(seed)

    out = Path(out)
    done = read_done(out)
    sources = take_shard(source_conversations(paths, limit), shard)
    todo = [(sid, msgs) for sid, msgs in sources if sid not in done]
    # long conversations together: less padding per batch, and out-of-memory shows up at once, not at the end
    todo.sort(key=lambda item: -sum(len(m["content"]) for m in item[1]))
    stats = RegenerateStats(already_done=len(sources) - len(todo))
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        out.open("a", encoding="utf-8") as f,
        tqdm(
            total=len(sources),
            initial=stats.already_done,
            desc="regenerate",
            unit="conv",
            disable=not progress,
        ) as bar,
    ):

        def write(dialogue: Dialogue) -> None:
            f.write(json.dumps(dialogue.record(generator), ensure_ascii=False) + "\n")
            f.flush()
            stats.written += 1
            stats.cut_conversations += dialogue.cut
            bar.update(1)

        def prompt_of(dialogue: Dialogue) -> list[int] | None:
            return dialogue.next_ids(tokenizer, max_prompt_tokens)

        def answered(dialogue: Dialogue, reply_ids: list[int], finished: bool) -> None:
            dialogue.answer(tokenizer.decode(reply_ids, skip_special_tokens=True), finished)
            stats.replies += 1
            stats.tokens += len(reply_ids) + finished
            stats.truncated_replies += not finished

        dialogues = [Dialogue(sid, msgs, reasoning, system, template_args) for sid, msgs in todo]
        deadline = None if max_seconds is None else time.perf_counter() + max_seconds

        def more() -> bool:
            return deadline is None or time.perf_counter() < deadline

        if batching == "continuous":
            config = generation_config(max_new_tokens, eos, pad_id, temperature)
            longest = (max_prompt_tokens or 4096) + max_new_tokens
            settings = batching_config(model.device, batch_size, longest)
            run_continuous(model, config, settings, dialogues, prompt_of, answered, write, more)
        else:
            for start in range(0, len(dialogues), batch_size):
                if not more():
                    break
                group = dialogues[start : start + batch_size]
                while group:
                    asking = [(d, ids) for d in group if (ids := prompt_of(d)) is not None]
                    if asking:
                        prompts = [ids for _, ids in asking]
                        replies = generate_replies(model, prompts, pad_id, eos, max_new_tokens, temperature)
                        for (dialogue, _), (reply_ids, finished) in zip(asking, replies):
                            answered(dialogue, reply_ids, finished)
                    for dialogue in group:
                        if dialogue.done:
                            write(dialogue)
                    group = [d for d in group if not d.done]
    stats.left_for_later = len(sources) - stats.already_done - stats.written
    return stats
