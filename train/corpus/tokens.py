"""Conversations into token rows: render with the target's chat template, mask, pack, collate, count.

The loss mask marks the tokens a draft must learn to predict: the content of each assistant message
and the end-of-turn token right after it. It is derived from where the template itself puts each
message (the conversation rendered prefix by prefix), so it works for any chat template.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from draftsmith.loading import tokenizer_fingerprint
from draftsmith.train.corpus.conversations import Message, load_conversations, restored, with_system
from draftsmith.train.infra.progress import StageLine
from draftsmith.train.objective import Batch

logger = logging.getLogger(__name__)

ROW_FEATURES = datasets.Features(  # Sequence, not List: datasets 3.x (pyproject allows it) has no List
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
    }
)
"""How rendered rows are stored: a token id in 4 bytes and its mask in 1, where Arrow's default for Python ints
(int64) takes 16 bytes a token for the two; the dataset cache and a memory-mapped read keep that size."""
PACKED_FEATURES = datasets.Features(
    {**ROW_FEATURES, "position_ids": datasets.Sequence(datasets.Value("int32"))}
)
""".. and packed rows' positions in 4 bytes as well (9 bytes a token instead of 24)."""


UNCALLED = "uncalled_tool_turns"
"""The rendered rows' count of tool-call turns their template drops (``render``'s ``uncalled``), summed for the
log and then removed."""


def render(
    messages: Sequence[Message],
    tokenizer,
    max_length: int,
    cut_replies: Sequence[int] = (),
    template_args: dict | None = None,
    uncalled: list[int] | None = None,
) -> list[dict[str, list[int]]]:
    """Tokenize one conversation with the tokenizer's chat template: rows of input_ids and a loss mask on
    what the target generates in each assistant turn (its content, or the whole turn the template renders
    after the generation prompt, tool calls and thinking included) and the end-of-turn token after it.

    For assistant message i, the template's text for ``messages[:i]`` with the generation prompt is where
    the reply starts, and its text for ``messages[:i + 1]`` is where the turn ends; the token right after
    the content is masked too when it is a special token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``: the
    draft must learn to stop) — except after the replies in ``cut_replies``, which were cut at a token
    budget: the template closes them, the target never did.

    The first row is the whole conversation, its turns masked where the template renders them as it did
    when they were the last. A template that rewrites earlier turns once later ones follow (Qwen3 strips
    the thinking of earlier replies) renders those turns otherwise in context; each such turn gets a row
    of its own, the conversation through it, so the loss is on what the target generated there. Every row
    is truncated to max_length. ``template_args`` go to the template (``enable_thinking``).

    An assistant turn with tool calls that the template renders without them (it names none of the called
    functions: SmolLM2's template drops ``tool_calls``) is left unmasked, context only: what it renders (a bare
    end-of-turn, or the content alone) is not what the target wrote there. Its index is appended to
    ``uncalled`` when that list is given.
    """
    check_chat_template(tokenizer)
    if not messages:
        raise ValueError("cannot render an empty conversation")
    if messages[0]["role"] == "assistant":
        raise ValueError(
            "conversation starts with an assistant message: nothing prompts it, so the template gives no "
            "place where the reply starts; drop leading assistant turns (load_conversations does)"
        )
    text = chat_text(tokenizer, messages, template_args=template_args)
    whole = _Row(text, tokenizer, max_length)
    own_rows = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = chat_text(tokenizer, messages[:i], add_generation_prompt=True, template_args=template_args)
        through = chat_text(tokenizer, messages[: i + 1], template_args=template_args)
        if not through.startswith(before):
            raise ValueError(_unreconciled(tokenizer, i, before, through))
        if message.get("tool_calls") and not _renders_a_call(message, through[len(before) :]):
            if uncalled is not None:
                uncalled.append(i)
            continue
        row = whole if text.startswith(through) else _Row(through, tokenizer, max_length)
        if len(before) < row.kept_chars:  # else the turn lies past the truncation
            row.mask_turn(message, before, through, i, cut=i in cut_replies)
            if row is not whole:
                own_rows.append(row)
    return [row.out() for row in (whole, *own_rows)]


def _renders_a_call(message: Message, turn: str) -> bool:
    """Whether the text a template gives an assistant turn names any function the turn calls."""
    return any(call["function"]["name"] in turn for call in message["tool_calls"])


class _Row:
    """One rendered text, tokenized and truncated, with the loss mask being filled turn by turn."""

    def __init__(self, text: str, tokenizer, max_length: int):
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError as err:
            raise ValueError(f"{_name(tokenizer)} gives no character offsets; use a fast tokenizer") from err
        self.input_ids = list(enc["input_ids"][:max_length])
        self.offsets = [tuple(o) for o in enc["offset_mapping"][: len(self.input_ids)]]
        self.starts = [s for s, _ in self.offsets]
        self.kept_chars = self.offsets[-1][1] if self.offsets else 0
        self.special = _special_ids(tokenizer)
        self.loss_mask = [0] * len(self.input_ids)

    def mask_turn(self, message: Message, before: str, through: str, index: int, cut: bool) -> None:
        """Mask assistant message ``index``, which the template renders as ``through[len(before):]``."""
        content = message["content"]
        span = None if message.get("tool_calls") or not content else _locate(content, through, len(before))
        if (
            span is None
        ):  # rewritten (thinking laid out anew) or more than content (tool calls): the whole turn
            stop = len(through.rstrip())
            last = self._token_at(stop - 1)
            if (
                last is not None
                and self.input_ids[last] in self.special
                and self.offsets[last][0] >= len(before)
            ):
                stop = self.offsets[last][0]  # the end-of-turn token: masked below unless the reply was cut
            span = (len(before), stop)
        start, stop = span
        # tokens overlapping [start, stop): a token that straddles the edge still carries content
        j = bisect.bisect_left(self.starts, start)
        while j > 0 and self.offsets[j - 1][1] > start:
            j -= 1
        while j < len(self.input_ids) and self.offsets[j][0] < stop:
            if self.offsets[j][1] > start:
                self.loss_mask[j] = 1
            j += 1
        ends_turn = (
            j < len(self.input_ids)
            and self.input_ids[j] in self.special
            and self.offsets[j][0] < len(through)
        )
        if ends_turn and not cut:
            self.loss_mask[j] = 1

    def _token_at(self, char: int) -> int | None:
        """The index of the token covering character ``char``, or None past the truncation."""
        j = bisect.bisect_right(self.starts, char) - 1
        return j if 0 <= j < len(self.input_ids) and self.offsets[j][1] > char else None

    def out(self) -> dict[str, list[int]]:
        return {"input_ids": self.input_ids, "loss_mask": self.loss_mask}


def _unreconciled(tokenizer, index: int, before: str, through: str) -> str:
    """The refusal for a turn whose rendering does not continue the prompt it was generated from."""
    at = next((k for k, (a, b) in enumerate(zip(before, through)) if a != b), min(len(before), len(through)))
    lo = max(0, at - 40)
    return (
        f"turn {index} (assistant): the chat template of {_name(tokenizer)} renders the prompt that asks for it "
        f"as ...{before[lo : at + 40]!r} but the conversation through it as ...{through[lo : at + 40]!r} (they "
        f"part at character {at}), so where the reply starts cannot be found. Render with a template whose "
        "generation prompt is the start of the turn it renders, or pass the template arguments the replies were "
        "written with (data.template_args, e.g. enable_thinking)"
    )


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
    system: str | None = None,
    template_args: dict | None = None,
) -> datasets.Dataset:
    """Load, shuffle (seed), keep ``limit`` conversations, render; pack into rows of max_length if asked.

    ``system`` is put first in every conversation that has no system message; ``template_args`` go to the
    chat template (``enable_thinking``). A conversation may give more than one row (``render``).

    Columns: ``input_ids``, ``loss_mask``; packed rows add ``position_ids``, which restart at 0 at each
    conversation. Attention masks do not stop at those boundaries: a loop that must keep conversations
    apart reads them from ``position_ids`` (flash-attention varlen, or a block-diagonal mask).
    Conversations with no assistant token left (none in the data, or all past max_length) are skipped.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 tokens, got {max_length}")
    check_chat_template(tokenizer)
    with StageLine("data", "read", unit="conversations") as read:
        convs = load_conversations(paths, stage=read).shuffle(seed=seed)
        if limit is not None:
            convs = convs.select(range(min(limit, len(convs))))
        read.done(f"{len(convs):,} conversations" + (f" (data.limit {limit:,})" if limit is not None else ""))
    args = json.dumps(template_args or {}, sort_keys=True)
    key = f"{convs._fingerprint}|{tokenizer_fingerprint(tokenizer)}|{max_length}|{system}|{args}"

    with StageLine("data", "render + mask", total=len(convs), unit="conversations") as stage:

        def render_batch(batch: dict[str, list]) -> dict[str, list]:
            out: dict[str, list] = {"input_ids": [], "loss_mask": [], UNCALLED: []}
            for row in (dict(zip(batch, values)) for values in zip(*batch.values())):
                messages = restored(row)
                shift = len(with_system(messages, system)) - len(messages)
                cut = [i + shift for i in row["cut_replies"]]
                uncalled: list[int] = []
                parts = render(
                    with_system(messages, system), tokenizer, max_length, cut, template_args, uncalled
                )
                for k, part in enumerate(parts):
                    out["input_ids"].append(part["input_ids"])
                    out["loss_mask"].append(part["loss_mask"])
                    out[UNCALLED].append(0 if k else len(uncalled))
                stage.update()
            return out

        with quiet_datasets():  # the stage's own line instead of datasets' bars (render, drop, ...)
            rendered = convs.map(
                render_batch,
                batched=True,
                batch_size=64,
                remove_columns=convs.column_names,
                features=datasets.Features({**ROW_FEATURES, UNCALLED: datasets.Value("int32")}),
                new_fingerprint=_hash("render", key, UNCALLED),
            )
            # counted from the stored column (Arrow's sum, no Python list of rows), so a render read back from
            # the dataset cache says it again
            uncalled = pc.sum(rendered.data.column(UNCALLED)).as_py() or 0
            rendered = rendered.remove_columns(UNCALLED)
            kept = rendered.filter(lambda mask: any(mask), input_columns="loss_mask")
        if uncalled:  # a warning, not a note: it says how to train on them
            logger.warning(
                "%d assistant turns with tool calls are context only, not trained on: the chat template of %s "
                "renders them without their calls, so their text is not what the target wrote. To train on "
                "tool calls, give a template that renders them (--target.chat_template=FILE)",
                uncalled,
                _name(tokenizer),
            )
        if len(kept) < len(rendered):
            stage.note(
                f"skipped {len(rendered) - len(kept):,} of {len(rendered):,} rendered rows with no assistant tokens: "
                f"none present, or all past max_length={max_length}"
            )
        stage.done(f"{len(convs):,} conversations -> {len(kept):,} rows")
    return pack_rows(kept, max_length, seed) if pack else kept


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """``datasets``' progress bars off for a block (its internal passes: a filter, flattening, saving), so the
    data stage shows one line per stage of its own; restored after."""
    was = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


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

    members = datasets.Dataset.from_dict({"members": bins})
    with StageLine("data", "pack", total=len(bins), unit="rows") as stage:

        def merge(batch: dict[str, list]) -> dict[str, list]:
            out: dict[str, list] = {"input_ids": [], "loss_mask": [], "position_ids": []}
            for indices in batch["members"]:
                parts = rendered[indices]
                out["input_ids"].append([t for ids in parts["input_ids"] for t in ids])
                out["loss_mask"].append([t for mask in parts["loss_mask"] for t in mask])
                out["position_ids"].append([p for ids in parts["input_ids"] for p in range(len(ids))])
                stage.update()
            return out

        with quiet_datasets():
            packed = members.map(
                merge,
                batched=True,
                batch_size=256,
                remove_columns=["members"],
                features=PACKED_FEATURES,
                new_fingerprint=_hash("pack", f"{rendered._fingerprint}|{max_length}"),
            )
        stage.done(f"{len(rendered):,} rows -> {len(bins):,} rows of at most {max_length} tokens")
    return packed.shuffle(seed=seed)


def split_heldout(
    ds: datasets.Dataset, n_heldout: int, seed: int = 0
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, heldout): ``n_heldout`` random rows held out, the rest for training."""
    if not 0 <= n_heldout < len(ds):
        raise ValueError(f"n_heldout={n_heldout} must be >= 0 and below the number of rows ({len(ds)})")
    if n_heldout == 0:
        return ds, ds.select([])
    # train_test_split's own permutation, with its index maps kept in memory: it would write them beside a
    # dataset read from disk, into the dataset cache that ranks and runs share
    order = np.random.default_rng(seed).permutation(len(ds))
    heldout, rest = order[:n_heldout], order[n_heldout:]
    return ds.select(rest, keep_in_memory=True), ds.select(heldout, keep_in_memory=True)


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


def pad_id_of(tokenizer) -> int:
    """The id padding slots hold (they are masked): the pad token, else EOS, else 0."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def count_tokens(dataset, vocab_size: int) -> torch.Tensor:
    """Frequency [V] (int64) of each token id at loss-masked positions: what the draft must predict."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for chunk in dataset.iter(batch_size=1024):
        ids = torch.cat([torch.as_tensor(x, dtype=torch.long) for x in chunk["input_ids"]])
        mask = torch.cat([torch.as_tensor(x, dtype=torch.bool) for x in chunk["loss_mask"]])
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def chat_text(
    tokenizer,
    messages: Sequence[Message],
    add_generation_prompt: bool = False,
    template_args: dict | None = None,
) -> str:
    """The chat template's text for these messages (tokenize it with add_special_tokens=False);
    ``template_args`` are the template's own variables (``enable_thinking``)."""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **(template_args or {})
    )


def _locate(content: str, through: str, begin: int) -> tuple[int, int] | None:
    """Character span of an assistant message's content inside its turn ``through[begin:]``; None when the
    template rewrites it."""
    for needle in (content, content.strip()):
        at = through.find(needle, begin)
        if at >= 0:
            return at, at + len(needle)
    return None


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for idx, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(token, "special", False):
            ids.add(int(idx))
    return ids


def _name(tokenizer) -> str:
    return repr(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _hash(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
