"""Self-distillation data: the target writes the assistant replies to the training prompts.

A draft learns to predict what the target says, so training on the target's own replies (instead of
whatever model wrote the dataset) raises acceptance. For each conversation the system and user turns are
kept and every assistant turn is replaced by the target's reply to the conversation so far — earlier
replies included, so later user turns may no longer quite follow; a conversation that ends with a user
turn gets a reply too. Nothing speculative: transformers' continuous batching (``batching="continuous"``:
a finished reply's row goes to the next prompt at once, by the library's own scheduler) or plain batched
``model.generate`` with left padding (``"static"``: a batch runs until its longest reply ends). The
default, ``"auto"``, is continuous on an accelerator and static on the CPU, where the library's paged
attention (without a flash kernel it attends over every request's keys, masked) measured slower than
padding (BENCHMARKS.md).

A reply that hits ``max_new_tokens`` is flagged (``truncated_replies``): its end-of-turn token was never
the target's, so training leaves such conversations out (``train/data.py``).

The output is JSONL in the ``messages`` shape with a ``source_id`` ("file name:record index"). Records
are appended and flushed one by one, so a rerun skips what is there and a killed run loses at most the
batch in flight; a partial last line left by a kill is cut off on resume.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.files import json_error
from draftsmith.loading import eos_token_ids
from draftsmith.sources import parse_source, source_name
from draftsmith.train.data import Message, chat_text, check_chat_template, iter_conversations

logger = logging.getLogger(__name__)


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


class _Dialogue:
    """One conversation being rewritten: walks the source turns, asks for a reply where one is due."""

    def __init__(self, source_id: str, source: list[Message]):
        self.source_id = source_id
        self.source = source
        self.pos = 0
        self.out: list[Message] = []
        self.done = False
        self.truncated = 0
        self.cut = False

    def next_prompt(self) -> list[Message] | None:
        """Copy system/user turns up to the next reply that is due; the messages to answer, or None."""
        if self.done:
            return None
        while self.pos < len(self.source):
            message = self.source[self.pos]
            self.pos += 1
            if message["role"] != "assistant":
                self.out.append(dict(message))
            elif self.out and self.out[-1]["role"] != "assistant":
                return self.out  # further assistant turns in a row are replaced by this one reply
        self.done = True
        return self.out if self.out and self.out[-1]["role"] == "user" else None

    def answer(self, reply: str, finished: bool) -> None:
        self.out.append({"role": "assistant", "content": reply})
        self.truncated += not finished

    def stop(self) -> None:
        """The prompt is too long: keep the conversation up to its last reply and end it."""
        last = max((i for i, m in enumerate(self.out) if m["role"] == "assistant"), default=None)
        if last is not None:
            del self.out[last + 1 :]
        self.done = self.cut = True

    def record(self) -> dict:
        rec: dict = {"source_id": self.source_id, "messages": self.out}
        if self.truncated:
            rec["truncated_replies"] = self.truncated
        if self.cut:
            rec["prompt_too_long"] = True
        return rec


def read_done(out: str | Path, key: str = "source_id") -> set[str]:
    """The ``key`` values (source_ids) already in ``out``; a partial last line (from a killed run) is cut
    off the file."""
    out = Path(out)
    if not out.exists():
        return set()
    data = out.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        logger.warning(
            "%s: dropping a partial last line (%d bytes) left by an interrupted run", out, len(data) - keep
        )
        with out.open("r+b") as f:
            f.truncate(keep)
    return record_ids(out, data[:keep].decode("utf-8"), key, "or write to a new --out file")


def record_ids(path: str | Path, text: str, key: str, fix: str) -> set[str]:
    """The ``key`` of every JSONL record in ``text`` (read from ``path``); an error naming the line and
    ending with ``fix`` for a line that is not a JSON object with that key."""
    ids: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            what = json_error(err, line).replace("at line 1, column", "at column", 1)
            raise ValueError(
                f"{path}: line {lineno} is not valid JSON, so it was not written by draftsmith or is damaged: {what}\n"
                f"Fix or delete that line, {fix}"
            ) from err
        if not isinstance(record, dict) or key not in record:
            raise ValueError(f'{path}: line {lineno} has no "{key}"; fix or delete that line, {fix}')
        ids.add(record[key])
    return ids


def source_conversations(
    paths: Sequence[str | Path], limit: int | None = None
) -> list[tuple[str, list[Message]]]:
    """(source_id, messages) for the first ``limit`` conversations of the sources (files, ``builtin:``
    names, ``hf:`` datasets), in order; a source id is "file name:record index" (for a dataset, its
    ``hf:`` spec in place of the file name)."""
    names: dict[str, str | Path] = {}
    for spec in paths:
        name = source_name(parse_source(spec))
        if name in names and parse_source(names[name]) != parse_source(spec):
            raise ValueError(
                f"{names[name]} and {spec} share the name {name!r}, which source ids are built from; "
                "rename one of them"
            )
        names[name] = spec
    found: list[tuple[str, list[Message]]] = []
    for name, spec in names.items():
        for index, messages in iter_conversations(spec):
            if limit is not None and len(found) >= limit:
                return found
            if messages:
                found.append((f"{name}:{index}", messages))
    return found


def first_user_turns(
    paths: Sequence[str | Path], count: int, max_chars: int = 2000, exclude: Collection[str] = ()
) -> list[dict]:
    """``count`` single-turn prompts: each conversation's first user turn (at most ``max_chars``
    characters), taken from the files in turn so every source is represented. Records are
    ``{"id": "file name:record index", "messages": [user turn]}``, input for ``regenerate``;
    ids in ``exclude`` (an earlier batch's) are skipped, so a second batch holds only new prompts."""
    from itertools import zip_longest

    def firsts(spec: str | Path):
        name = source_name(parse_source(spec))
        for index, messages in iter_conversations(spec):
            user = next((m for m in messages if m["role"] == "user"), None)
            pid = f"{name}:{index}"
            if user and 0 < len(user["content"]) <= max_chars and pid not in exclude:
                yield {"id": pid, "messages": [user]}

    chosen: list[dict] = []
    for group in zip_longest(*(firsts(p) for p in paths)):
        chosen.extend(r for r in group if r is not None)
        if len(chosen) >= count:
            break
    return chosen[:count]


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
) -> RegenerateStats:
    """Rewrite the assistant turns of the conversations in ``paths`` with ``model``; append to ``out``.

    ``max_prompt_tokens`` (default: the model's context length minus max_new_tokens) stops a conversation
    whose prompt grows past it, keeping the turns already answered. temperature 0 is greedy decoding.
    ``batch_size``: conversations in flight at once; ``batching``: ``auto``, ``continuous`` or ``static``.
    ``max_seconds``: start no conversation after this long (those in flight finish); a rerun resumes.
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
    sources = source_conversations(paths, limit)
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

        def write(dialogue: _Dialogue) -> None:
            f.write(json.dumps(dialogue.record(), ensure_ascii=False) + "\n")
            f.flush()
            stats.written += 1
            bar.update(1)

        def prompt_of(dialogue: _Dialogue) -> list[int] | None:
            """The token ids of the dialogue's next prompt, or None once it is done (too long, or over)."""
            while (messages := dialogue.next_prompt()) is not None:
                ids = tokenizer(
                    chat_text(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False
                )["input_ids"]
                if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
                    return ids
                dialogue.stop()
                stats.cut_conversations += 1
            return None

        def answered(dialogue: _Dialogue, reply_ids: list[int], finished: bool) -> None:
            dialogue.answer(tokenizer.decode(reply_ids, skip_special_tokens=True), finished)
            stats.replies += 1
            stats.tokens += len(reply_ids) + finished
            stats.truncated_replies += not finished

        dialogues = [_Dialogue(sid, msgs) for sid, msgs in todo]
        deadline = None if max_seconds is None else time.perf_counter() + max_seconds

        def more() -> bool:
            return deadline is None or time.perf_counter() < deadline

        if batching == "continuous":
            config = _generation_config(max_new_tokens, eos, pad_id, temperature)
            longest = (max_prompt_tokens or 4096) + max_new_tokens
            batching_config = _batching_config(model.device, batch_size, longest)
            run_continuous(model, config, batching_config, dialogues, prompt_of, answered, write, more)
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


BATCHING = ("auto", "continuous", "static")


def _generation_config(max_new_tokens: int, eos: list[int], pad_id: int, temperature: float):
    from transformers import GenerationConfig

    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad_id, **sampling)


def _batching_config(device: torch.device, in_flight: int, longest: int):
    """The continuous-batching settings for ``in_flight`` requests of at most ``longest`` tokens each.

    On an accelerator the library sizes its paged cache from free memory. On the CPU it would take 60 %
    of RAM, and touching that much memory slows decoding (measured: BENCHMARKS.md, "Regeneration"), so
    there the cache holds just the requests in flight, with prefill chunks of 1,024 tokens.
    """
    from transformers import ContinuousBatchingConfig

    if device.type != "cpu":
        return ContinuousBatchingConfig(max_requests_per_batch=in_flight)
    page = ContinuousBatchingConfig().page_size
    return ContinuousBatchingConfig(
        max_requests_per_batch=in_flight,
        num_blocks=in_flight * -(-longest // page),
        max_batch_tokens=1024,
    )


@torch.inference_mode()
def run_continuous(model, config, batching_config, dialogues, prompt_of, answered, write, more) -> None:
    """Every dialogue through transformers' continuous-batching manager, as many at a time as
    ``batching_config.max_requests_per_batch``.

    A dialogue's next turn is asked for as soon as its last reply returns, and a new dialogue starts as
    soon as one ends; the library schedules the requests and refills finished rows. A dialogue is written
    the moment it ends, so a killed run loses only the dialogues in flight. No dialogue starts once
    ``more()`` is false.
    """
    stop = set(config.eos_token_id)
    waiting = iter(range(len(dialogues)))  # dialogues not started yet, in order
    asked: dict[str, int] = {}  # request id -> dialogue index
    in_flight = batching_config.max_requests_per_batch
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=batching_config, warmup=False
    ) as manager:

        def advance(i: int) -> None:
            """Ask for dialogue i's next reply, or write it when it has none left."""
            ids = prompt_of(dialogues[i])
            if ids is None:
                write(dialogues[i])
                return
            request = manager.add_request(
                ids, request_id=f"d{i}:{len(asked)}", max_new_tokens=config.max_new_tokens
            )
            asked[request] = i

        def fill() -> None:
            while len(asked) < in_flight and more() and (i := next(waiting, None)) is not None:
                advance(i)

        fill()
        while asked:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(
                        "transformers' continuous-batching loop stopped before every reply came"
                    )
                continue
            if not result.is_finished():
                continue
            i = asked.pop(result.request_id)
            reply = list(result.generated_tokens)
            finished = bool(reply) and reply[-1] in stop
            answered(dialogues[i], reply[:-1] if finished else reply, finished)
            advance(i)
            fill()


@torch.inference_mode()
def generate_replies(
    model, prompts: list[list[int]], pad_id: int, eos: list[int], max_new_tokens: int, temperature: float
) -> list[tuple[list[int], bool]]:
    """Generate one reply per prompt in one left-padded batch: (reply token ids, ended with an eos token)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, prompt in enumerate(prompts):
        input_ids[b, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        attention_mask[b, width - len(prompt) :] = 1
    device = next(model.parameters()).device
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    sequences = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos,
        **sampling,
    )
    replies = []
    stop = set(eos)
    for row in sequences[:, width:].tolist():
        end = next((i for i, t in enumerate(row) if t in stop), None)
        replies.append((row if end is None else row[:end], end is not None))
    return replies
