"""Training conversations: load (any common shape), render with the target's chat template, mask, pack.

The loss mask marks the tokens a draft must learn to predict: the content of each assistant message
and the end-of-turn token right after it. It is derived from where the template itself puts each
message (the conversation rendered prefix by prefix), so it works for any chat template.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets
import torch

from draftsmith.files import json_error, open_text, read_jsonl
from draftsmith.loading import tokenizer_fingerprint
from draftsmith.sources import DataSourceError, HubSource, parse_source
from draftsmith.train.objective import Batch

logger = logging.getLogger(__name__)

Message = dict[str, str]

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
SHAPES = (
    'ShareGPT {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}',
    '{"messages": [{"role": "system"|"user"|"assistant", "content": ...}]}',
    '{"question": ..., "answer": ...}',
    '{"instruction": ..., "input": ... (optional), "response" or "output": ...}',
)
MESSAGES_FEATURES = datasets.Features(
    {"messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})}
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
        turns = [(_field(t, "role", where), _field(t, "content", where)) for t in record["messages"]]
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
    messages = []
    for n, (role, content) in enumerate(turns):
        if role not in ROLE_ALIASES:
            raise ValueError(
                f"{where}, turn {n}: unknown role {role!r}; known roles: {', '.join(sorted(ROLE_ALIASES))}"
            )
        if not isinstance(content, str):
            raise ValueError(f"{where}, turn {n}: content is {type(content).__name__}, expected a string")
        messages.append({"role": ROLE_ALIASES[role], "content": content})
    return messages


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


def load_conversations(paths: Sequence[str | Path]) -> datasets.Dataset:
    """Load conversation sources (JSON/JSONL files, ``builtin:`` names, ``hf:`` datasets) into a Dataset
    with one column ``messages``.

    Each record may be in any shape of ``SHAPES`` (told per record). Skipped, and counted in the log:
    records with no messages left after dropping leading assistant turns (see ``iter_conversations``),
    and records ``data regenerate`` flagged with ``truncated_replies`` (a reply cut at max_new_tokens
    ends where the target never ended it; trained on, it teaches the draft an ending that never comes).
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ValueError("no data given; pass at least one JSON/JSONL file, builtin: name or hf: dataset")
    rows, empty, cut = [], 0, 0
    for path in paths:
        for _, messages, record in _iter_records(path):
            if not messages:
                empty += 1
            elif record.get("truncated_replies"):
                cut += 1
            else:
                rows.append({"messages": messages})
    if empty:
        logger.warning("skipped %d conversations that held only assistant turns", empty)
    if cut:
        logger.warning(
            "skipped %d conversations with a reply cut at max_new_tokens (flagged truncated_replies by "
            "`draftsmith data regenerate`; regenerate with a larger --max-new-tokens to keep them)",
            cut,
        )
    if not rows:
        raise ValueError(f"no usable conversations in {', '.join(map(str, paths))} (see the warnings above)")
    return datasets.Dataset.from_list(rows, features=MESSAGES_FEATURES)


def render(messages: Sequence[Message], tokenizer, max_length: int) -> dict[str, list[int]]:
    """Tokenize one conversation with the tokenizer's chat template; mask = assistant content + end of turn.

    For assistant message i, the template's text for ``messages[:i]`` with the generation prompt is where
    the reply starts, and its text for ``messages[:i + 1]`` is where the turn ends; the content is
    located inside that span, and the token right after it is masked too when it is a special token
    (``<|im_end|>``, ``<|eot_id|>``, ``</s>``: the draft must learn to stop). Truncated to max_length.
    """
    check_chat_template(tokenizer)
    if not messages:
        raise ValueError("cannot render an empty conversation")
    if messages[0]["role"] == "assistant":
        raise ValueError(
            "conversation starts with an assistant message: nothing prompts it, so the template gives no "
            "place where the reply starts; drop leading assistant turns (load_conversations does)"
        )
    text = chat_text(tokenizer, messages)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as err:
        raise ValueError(f"{_name(tokenizer)} gives no character offsets; use a fast tokenizer") from err
    input_ids = list(enc["input_ids"][:max_length])
    offsets = [tuple(o) for o in enc["offset_mapping"][: len(input_ids)]]
    starts = [s for s, _ in offsets]
    kept_chars = offsets[-1][1] if offsets else 0
    special = _special_ids(tokenizer)
    loss_mask = [0] * len(input_ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat_text(tokenizer, messages[:i], add_generation_prompt=True)
        if len(before) >= kept_chars:
            break  # the rest lies past the truncation
        through = chat_text(tokenizer, messages[: i + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(
                f"the chat template of {_name(tokenizer)} renders earlier turns differently once later turns "
                "are added, so message positions cannot be read from prefix renders; render these "
                "conversations with a template whose output for a prefix is a prefix of the whole"
            )
        start, stop = _locate(message["content"], through, len(before), i)
        # tokens overlapping [start, stop): a token that straddles the edge still carries content
        j = bisect.bisect_left(starts, start)
        while j > 0 and offsets[j - 1][1] > start:
            j -= 1
        while j < len(input_ids) and offsets[j][0] < stop:
            if offsets[j][1] > start:
                loss_mask[j] = 1
            j += 1
        if j < len(input_ids) and input_ids[j] in special and offsets[j][0] < len(through):
            loss_mask[j] = 1
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def check_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {_name(tokenizer)} has no chat template, so conversations cannot be rendered. Use an "
            "instruct/chat model, or give a template as a Jinja file: --target.chat_template=FILE for "
            "`draftsmith train`, --chat-template FILE for `draftsmith eval` and `draftsmith data` (in Python: "
            "tokenizer.chat_template = open(FILE).read())"
        )


def build_dataset(
    paths: Sequence[str | Path],
    tokenizer,
    max_length: int,
    pack: bool = False,
    limit: int | None = None,
    seed: int = 0,
) -> datasets.Dataset:
    """Load, shuffle (seed), keep ``limit`` conversations, render; pack into rows of max_length if asked.

    Columns: ``input_ids``, ``loss_mask``; packed rows add ``position_ids``, which restart at 0 at each
    conversation. Attention masks do not stop at those boundaries: a loop that must keep conversations
    apart reads them from ``position_ids`` (flash-attention varlen, or a block-diagonal mask).
    Conversations with no assistant token left (none in the data, or all past max_length) are skipped.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 tokens, got {max_length}")
    check_chat_template(tokenizer)
    convs = load_conversations(paths).shuffle(seed=seed)
    if limit is not None:
        convs = convs.select(range(min(limit, len(convs))))
    key = f"{convs._fingerprint}|{tokenizer_fingerprint(tokenizer)}|{max_length}"
    rendered = convs.map(
        lambda row: render(row["messages"], tokenizer, max_length),
        remove_columns=["messages"],
        desc="render + mask",
        num_proc=1,
        new_fingerprint=_hash("render", key),
    )
    kept = rendered.filter(lambda mask: any(mask), input_columns="loss_mask", desc="drop no-assistant")
    if len(kept) < len(rendered):
        logger.warning(
            "skipped %d of %d conversations with no assistant tokens (none present, or all past max_length=%d)",
            len(rendered) - len(kept),
            len(rendered),
            max_length,
        )
    return pack_rows(kept, max_length, seed) if pack else kept


def pack_rows(rendered: datasets.Dataset, max_length: int, seed: int = 0) -> datasets.Dataset:
    """Pack whole conversations (each <= max_length) into rows of at most max_length, best fit decreasing.

    No conversation is split, so every token is kept and each keeps its whole context; rows are shuffled.
    """
    lengths = [len(ids) for ids in rendered["input_ids"]]
    if any(n > max_length for n in lengths):
        raise ValueError(
            f"a conversation is longer than max_length={max_length}; render with that max_length"
        )
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room left, bin index)
    for idx in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        pos = bisect.bisect_left(free, (lengths[idx], -1))
        if pos < len(free):
            room, b = free.pop(pos)
        else:
            room, b = max_length, len(bins)
            bins.append([])
        bins[b].append(idx)
        bisect.insort(free, (room - lengths[idx], b))

    def merge(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "loss_mask": [], "position_ids": []}
        for members in batch["members"]:
            parts = rendered[members]
            out["input_ids"].append([t for ids in parts["input_ids"] for t in ids])
            out["loss_mask"].append([t for mask in parts["loss_mask"] for t in mask])
            out["position_ids"].append([p for ids in parts["input_ids"] for p in range(len(ids))])
        return out

    members = datasets.Dataset.from_dict({"members": bins})
    packed = members.map(
        merge,
        batched=True,
        batch_size=256,
        remove_columns=["members"],
        desc="pack",
        num_proc=1,
        new_fingerprint=_hash("pack", f"{rendered._fingerprint}|{max_length}"),
    )
    return packed.shuffle(seed=seed)


def split_heldout(
    ds: datasets.Dataset, n_heldout: int, seed: int = 0
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, heldout): ``n_heldout`` random rows held out, the rest for training."""
    if not 0 <= n_heldout < len(ds):
        raise ValueError(f"n_heldout={n_heldout} must be >= 0 and below the number of rows ({len(ds)})")
    if n_heldout == 0:
        return ds, ds.select([])
    parts = ds.train_test_split(test_size=n_heldout, shuffle=True, seed=seed)
    return parts["train"], parts["test"]


def collate(rows: Sequence[dict], pad_id: int) -> Batch:
    """Right-pad rows of input_ids/loss_mask into a Batch (attention_mask 1 on real tokens).

    Packed rows' ``position_ids`` are padded with 0 and handed on when ``Batch`` has such a field.
    """
    if not rows:
        raise ValueError("collate got no rows")
    width = max(len(r["input_ids"]) for r in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.long)
    with_positions = "position_ids" in rows[0] and "position_ids" in Batch.__dataclass_fields__
    position_ids = torch.zeros(shape, dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
        if with_positions:
            position_ids[b, :n] = torch.as_tensor(row["position_ids"], dtype=torch.long)
    extra = {"position_ids": position_ids} if with_positions else {}
    return Batch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, **extra)


def chat_text(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The chat template's text for these messages (tokenize it with add_special_tokens=False)."""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _locate(content: str, through: str, begin: int, index: int) -> tuple[int, int]:
    """Character span of an assistant message's content inside its turn ``through[begin:]``."""
    for needle in (content, content.strip()):
        at = through.find(needle, begin)
        if at >= 0:
            return at, at + len(needle)
    raise ValueError(
        f"message {index} (assistant): the chat template rewrites its content, so it cannot be found in the "
        "rendered turn; the loss mask needs the content rendered verbatim (stripping whitespace is fine)"
    )


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for idx, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(token, "special", False):
            ids.add(int(idx))
    return ids


def _name(tokenizer) -> str:
    return repr(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _shapes() -> str:
    return "; ".join(SHAPES)


def _hash(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _field(turn: object, key: str, where: str) -> object:
    if not isinstance(turn, dict) or key not in turn:
        keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
        raise ValueError(f"{where}: a turn lacks {key!r} (it has {keys}); accepted shapes: {_shapes()}")
    return turn[key]


def pad_id_of(tokenizer) -> int:
    """The id padding slots hold (they are masked): the pad token, else EOS, else 0."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0
