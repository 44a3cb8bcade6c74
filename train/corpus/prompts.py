"""Which conversations and prompts a data job works on: every conversation of the sources under a stable
id, the first user turn of each (``data prompts``), and the ids an earlier run already wrote to its
output (so a rerun resumes where it stopped).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Sequence
from itertools import zip_longest
from pathlib import Path

from draftsmith.files import json_error
from draftsmith.sources import expand_sources, parse_source, source_name
from draftsmith.train.corpus.conversations import Message, iter_conversations

logger = logging.getLogger(__name__)


def source_conversations(
    paths: Sequence[str | Path], limit: int | None = None
) -> list[tuple[str, list[Message]]]:
    """(source_id, messages) for the first ``limit`` conversations of the sources (files, ``builtin:``
    names, ``hf:`` datasets), in order; a source id is "file name:record index" (for a dataset, its
    ``hf:`` spec in place of the file name)."""
    names: dict[str, str | Path] = {}
    for spec in expand_sources(paths):
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


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N): the I-th of N disjoint shards, I counted from 0 as SLURM array task ids are."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected I/N, e.g. 0/4 (I counts from 0)") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"--shard {text!r}: I must be 0..N-1 and N at least 1 (0/4, 1/4, 2/4, 3/4)")
    return index, count


def take_shard(items: list, shard: tuple[int, int] | None) -> list:
    """The items of shard (i, n): those at positions i, i + n, i + 2n, ... of the input order. n jobs with
    i = 0..n-1 take every item exactly once, whatever the sources' sizes; None takes all."""
    if shard is None:
        return items
    index, count = shard
    return items[index::count]


def first_user_turns(
    paths: Sequence[str | Path], count: int, max_chars: int = 2000, exclude: Collection[str] = ()
) -> list[dict]:
    """``count`` single-turn prompts: each conversation's first user turn (at most ``max_chars``
    characters), taken from the files in turn so every source is represented. Records are
    ``{"id": "file name:record index", "messages": [user turn]}``, input for ``regenerate``;
    ids in ``exclude`` (an earlier batch's) are skipped, so a second batch holds only new prompts."""

    def firsts(spec: str | Path):
        name = source_name(parse_source(spec))
        for index, messages in iter_conversations(spec):
            user = next((m for m in messages if m["role"] == "user"), None)
            pid = f"{name}:{index}"
            if user and 0 < len(user["content"]) <= max_chars and pid not in exclude:
                yield {"id": pid, "messages": [user]}

    chosen: list[dict] = []
    for group in zip_longest(*(firsts(p) for p in expand_sources(paths))):
        chosen.extend(r for r in group if r is not None)
        if len(chosen) >= count:
            break
    return chosen[:count]


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
