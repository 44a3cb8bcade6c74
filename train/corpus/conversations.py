"""Training conversations in any common shape: read a file, a built-in data set or a Hub dataset into
``{"role", "content"}`` messages.

The shapes are told per record (``SHAPES``); errors name the file, the record and its line. Rendering
the messages into token rows is ``tokens.py``'s job.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets

from draftsmith.files import json_error, open_text, read_jsonl
from draftsmith.sources import DataSourceError, HubSource, expand_sources, parse_source
from draftsmith.train.infra.progress import StageLine

logger = logging.getLogger(__name__)

Message = dict[str, Any]
"""``{"role", "content"}``, and ``tool_calls`` (a list, as chat templates read it) on an assistant message
that calls tools."""

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
CONTEXT_ROLES = {"tool": "tool", "function": "tool", "ipython": "tool"}
"""Roles kept as context and never trained on: what a tool returned. Rendered as role ``tool`` (the name
chat templates read; Llama-3.1's renders it under its ``ipython`` header)."""
SHAPES = (
    'ShareGPT {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}',
    '{"messages": [{"role": "system"|"user"|"assistant", "content": ...}]}',
    '{"question": ..., "answer": ...}',
    '{"instruction": ..., "input": ... (optional), "response" or "output": ...}',
)
MESSAGES_FEATURES = datasets.Features(
    {
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "cut_replies": datasets.List(datasets.Value("int32")),  # assistant messages cut at max_new_tokens
        # the tool calls of assistant messages, as JSON (arguments differ in shape from call to call)
        "tool_calls": datasets.List({"message": datasets.Value("int32"), "calls": datasets.Value("string")}),
    }
)


def read_records(path: str | Path) -> Iterator[tuple[int, int, object]]:
    """Yield (record index, line number, record) from a JSON list file or a JSONL file, either of them
    gzip-compressed or not.

    The format is told by the content, not the name: a file whose first character is ``[`` is one
    JSON list, anything else is one JSON value per line (blank lines skipped).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    with open_text(path) as f:
        head = f.read(4096).lstrip()
        if not head:
            raise ValueError(
                f"{path} is empty; pass a JSON list or a JSONL file with one conversation a line"
            )
        f.seek(0)
        if head.startswith("["):
            text = f.read()
            try:
                records = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: malformed JSON: {json_error(err, text)}") from err
            if not records:
                raise ValueError(f"{path} holds an empty JSON list; it has no conversations")
            for index, record in enumerate(records):
                yield index, 0, record
            return
    for index, (lineno, record) in enumerate(read_jsonl(path, "one conversation")):
        yield index, lineno, record


def to_messages(record: object, where: str) -> list[Message]:
    """Convert one record of any accepted shape to a list of {"role", "content"} messages.

    ``where`` names the record in error messages (file, index, line).
    """
    if not isinstance(record, dict):
        raise ValueError(
            f"{where} is a {type(record).__name__}, not a JSON object; accepted shapes: {_shapes()}"
        )
    if isinstance(record.get("conversations"), list):
        turns = [(_field(t, "from", where), _field(t, "value", where)) for t in record["conversations"]]
    elif isinstance(record.get("messages"), list):
        turns = [
            (_field(t, "role", where), t.get("content") if _calls_tools(t) else _field(t, "content", where))
            for t in record["messages"]
        ]
    elif "question" in record and "answer" in record:
        turns = [("user", record["question"]), ("assistant", record["answer"])]
    elif "instruction" in record and ("response" in record or "output" in record):
        prompt = record["instruction"]
        extra = record.get("input") or ""
        if isinstance(prompt, str) and isinstance(extra, str) and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        turns = [("user", prompt), ("assistant", record["response" if "response" in record else "output"])]
    else:
        raise ValueError(
            f"{where} has keys {sorted(record)}, which match no known shape; accepted shapes: {_shapes()}"
        )
    raw = record.get("messages") if isinstance(record.get("messages"), list) else None
    messages = []
    for n, (role, content) in enumerate(turns):
        name = (ROLE_ALIASES.get(role) or CONTEXT_ROLES.get(role)) if isinstance(role, str) else None
        if name is None:
            known = ", ".join(sorted([*ROLE_ALIASES, *CONTEXT_ROLES]))
            raise ValueError(
                f"{where}, turn {n}: unknown role {role!r}; known roles: {known} (rename it to one of them, "
                "or drop the turn)"
            )
        calls = raw[n].get("tool_calls") if raw is not None and isinstance(raw[n], dict) else None
        message: Message = {"role": name, "content": _text(content, calls, f"{where}, turn {n}")}
        if calls:
            if name != "assistant":
                raise ValueError(
                    f"{where}, turn {n}: a {role!r} message has tool_calls; only assistant messages call tools"
                )
            message["tool_calls"] = _tool_calls(calls, f"{where}, turn {n}")
        messages.append(message)
    return messages


def _text(content: object, calls: object, where: str) -> str:
    """A message's content as one string: a string, or a list of text parts joined (OpenAI's
    ``[{"type": "text", "text": ...}]``); an assistant message that only calls tools may have none."""
    if isinstance(content, str):
        return content
    if content is None and calls:
        return ""
    if not isinstance(content, list):
        raise ValueError(
            f"{where}: content is {type(content).__name__}, expected a string or a list of text parts"
        )
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(
                f'{where}: content part {k} is of type {kind!r}; only text parts ({{"type": "text", '
                '"text": ...}) can be trained on: drop the other parts or the record'
            )
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls(calls: object, where: str) -> list[dict]:
    """Tool calls as chat templates read them: ``{"type": "function", "function": {"name", "arguments"}}``
    with the arguments an object (OpenAI sends them as a JSON string, which Llama-3.1's template would
    quote once more)."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}: tool_calls is {type(calls).__name__}, expected a list of calls")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(
                f'{where}: tool call {k} has no function name; expected {{"type": "function", "function": '
                '{"name": ..., "arguments": {...}}}'
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: tool call {k}'s arguments are not JSON: {err}") from err
        named = {"id": call["id"]} if isinstance(call.get("id"), str) else {}
        out.append({**named, "type": "function", "function": {**function, "arguments": arguments}})
    return out


def with_system(messages: list[Message], system: str | None) -> list[Message]:
    """``messages`` with a system prompt put first when they have none (``data.system``, ``--system``)."""
    if not system or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system}, *messages]


def iter_conversations(spec: str | Path) -> Iterator[tuple[int, list[Message]]]:
    """Yield (record index, messages) for every record of one source: a JSON/JSONL file, a built-in
    data set (``builtin:NAME``) or a dataset loaded by ``datasets`` (``hf:ID:SPLIT``, see
    ``draftsmith.sources``).

    Leading assistant turns are dropped: ShareGPT dumps split long conversations into chunks, and a
    chunk may start mid-conversation with the assistant answering a question it no longer contains.
    A record left with no messages yields an empty list.
    """
    for index, messages, _ in _iter_records(spec):
        yield index, messages


def _iter_records(spec: str | Path) -> Iterator[tuple[int, list[Message], object]]:
    source = parse_source(spec)
    if isinstance(source, HubSource):
        records = ((index, f"{source}: row {index}", record) for index, record in hub_records(source))
    else:
        records = (
            (index, f"{spec}: record {index}" + (f" (line {lineno})" if lineno else ""), record)
            for index, lineno, record in read_records(source)
        )
    for index, where, record in records:
        messages = to_messages(record, where)
        first = next((i for i, m in enumerate(messages) if m["role"] != "assistant"), len(messages))
        yield index, messages[first:], record


def hub_records(source: HubSource) -> Iterator[tuple[int, dict]]:
    """(row index, row) of a dataset through ``datasets.load_dataset``, at most ``source.take`` rows.

    Streaming reads rows as they are used (memory bounded by the rows taken); otherwise the split is
    downloaded (or found in the cache) whole and memory-mapped. Its columns are checked against the
    accepted shapes before any row is read. Errors name the dataset: offline with no cached copy, a split
    or config it lacks (listing the ones it has), columns that match no shape (listing the ones found).
    """
    try:
        dataset = datasets.load_dataset(
            source.path,
            name=source.config,
            split=source.split,
            revision=source.revision,
            streaming=source.streaming,
        )
    except ConnectionError as err:
        raise DataSourceError(
            f"{source}: the Hub cannot be reached and no copy is cached here ({err}). Load it once on a "
            "machine with network access (the copy lands in the datasets cache, HF_HOME), copy the dataset "
            "folder here and pass hf:FOLDER:SPLIT, or use a local JSON/JSONL file"
        ) from err
    except ValueError as err:  # an unknown split or config: datasets lists the ones there are
        raise DataSourceError(f"{source}: {err}") from err
    except FileNotFoundError as err:
        raise DataSourceError(f"{source}: no such dataset ({err})") from err
    columns = dataset.column_names
    if columns is None:  # a stream whose features are not declared: read them off the first row
        columns = list(next(iter(dataset), {}))
    if not shape_of_columns(columns):
        raise DataSourceError(
            f"{source} has columns {sorted(columns)}, which match no known shape; accepted shapes: {_shapes()}"
        )
    if source.streaming:
        # read the rows taken, then close the stream: a stream left open mid-file may abort the
        # interpreter at exit (pyarrow's reader threads, apache/arrow#45214)
        stream = iter(dataset)
        try:
            rows = list(itertools.islice(stream, source.take))
        finally:
            stream.close()
        yield from enumerate(rows)
        return
    if source.take is not None:
        dataset = dataset.select(range(min(source.take, len(dataset))))
    yield from enumerate(dataset)


def shape_of_columns(columns: Sequence[str]) -> str | None:
    """The accepted shape (an entry of ``SHAPES``) that records with these keys are read as, or None."""
    keys = set(columns)
    if "conversations" in keys:
        return SHAPES[0]
    if "messages" in keys:
        return SHAPES[1]
    if {"question", "answer"} <= keys:
        return SHAPES[2]
    if "instruction" in keys and keys & {"response", "output"}:
        return SHAPES[3]
    return None


def load_conversations(paths: Sequence[str | Path], stage: StageLine | None = None) -> datasets.Dataset:
    """Load conversation sources (JSON/JSONL files or patterns of them, ``builtin:`` names, ``hf:`` datasets) into a Dataset
    with columns ``messages``, ``cut_replies`` and ``tool_calls`` (``stored``; ``restored`` gives the messages).

    Each record may be in any shape of ``SHAPES`` (told per record). ``cut_replies`` lists the assistant
    messages ``data regenerate`` cut at max_new_tokens (indices into ``messages``): the reply is the target's
    own, the end of turn after it is not, and ``tokens.render`` learns the one and not the other. A record
    from before the list was written has only the count ``truncated_replies``; it is kept when the count
    says which replies were cut (all of them), else skipped and counted. Skipped too: records with no
    messages left after dropping leading assistant turns (see ``iter_conversations``). What is skipped is
    said in ``stage``'s line where one shows the reading (``train/infra/progress.StageLine``), else logged.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ValueError("no data given; pass at least one JSON/JSONL file, builtin: name or hf: dataset")
    paths = expand_sources(paths)  # a pattern (the shards of a sharded regeneration) names its files
    rows, empty, unclear = [], 0, 0
    for path in paths:
        for _, messages, record in _iter_records(path):
            cut = _cut_replies(messages, record)
            if not messages:
                empty += 1
            elif cut is None:
                unclear += 1
            else:
                rows.append(stored(messages, cut))
            if stage is not None:
                stage.update()
    skipped = []
    if empty:
        skipped.append(f"skipped {empty:,} conversations that held only assistant turns")
    if unclear:
        skipped.append(
            f"skipped {unclear:,} conversations flagged truncated_replies with no cut_replies list, so which reply "
            "was cut at max_new_tokens is not known (written by an older `draftsmith data regenerate`; rerun it "
            "into a new file to keep them)"
        )
    if not rows:
        why = "; ".join(skipped) or "they hold no conversation"
        raise ValueError(f"no usable conversations in {', '.join(map(str, paths))}: {why}")
    for text in skipped:
        if stage is None:
            logger.warning(text)
        else:
            stage.note(text)
    return datasets.Dataset.from_list(rows, features=MESSAGES_FEATURES)


def stored(messages: list[Message], cut_replies: list[int]) -> dict:
    """A row of ``MESSAGES_FEATURES``: the messages' roles and text, the cut replies, and the tool calls by
    message index as JSON (``restored`` reads them back)."""
    calls = [
        {"message": i, "calls": json.dumps(m["tool_calls"])}
        for i, m in enumerate(messages)
        if m.get("tool_calls")
    ]
    return {
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
        "cut_replies": cut_replies,
        "tool_calls": calls,
    }


def restored(row: dict) -> list[Message]:
    """The messages of a ``stored`` row, tool calls put back on their assistant messages."""
    messages = [dict(m) for m in row["messages"]]
    for entry in row.get("tool_calls") or ():
        messages[entry["message"]]["tool_calls"] = json.loads(entry["calls"])
    return messages


def _cut_replies(messages: list[Message], record: object) -> list[int] | None:
    """Indices into ``messages`` of the replies cut at max_new_tokens; None when the record does not say which."""
    if not isinstance(record, dict) or not record.get("truncated_replies"):
        return []
    # leading assistant turns dropped by _iter_records (regenerated data has none)
    dropped = len(record.get("messages", ())) - len(messages)
    listed = record.get("cut_replies")
    if listed is not None:
        cut = [i - dropped for i in listed]
        if not all(0 <= i < len(messages) and messages[i]["role"] == "assistant" for i in cut):
            raise ValueError(
                f"record {record.get('source_id', '?')}: cut_replies {listed} must name assistant messages (indices "
                f"into its {len(record['messages'])} messages); fix the list or drop the record"
            )
        return cut
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return replies if record["truncated_replies"] == len(replies) else None


def _shapes() -> str:
    return "; ".join(SHAPES)


def _calls_tools(turn: object) -> bool:
    return isinstance(turn, dict) and bool(turn.get("tool_calls"))


def _field(turn: object, key: str, where: str) -> object:
    if not isinstance(turn, dict) or key not in turn:
        keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
        raise ValueError(f"{where}: a turn lacks {key!r} (it has {keys}); accepted shapes: {_shapes()}")
    return turn[key]
