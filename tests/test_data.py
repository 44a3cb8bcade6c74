"""Loading every conversation shape, the assistant loss mask, packing, collation and their errors."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest
import torch
from tiny import tiny_tokenizer

from draftsmith.files import open_text
from draftsmith.sources import BUILTIN_TRAIN, builtin_path
from draftsmith.train.corpus.conversations import load_conversations
from draftsmith.train.corpus.tokens import build_dataset, collate, pack_rows, render, split_heldout

SYSTEM = {"role": "system", "content": "Be brief."}
Q1 = {"role": "user", "content": "What is 2+2?"}
A1 = {"role": "assistant", "content": "4, of course."}
Q2 = {"role": "user", "content": "And times 3? ünïcode"}
A2 = {"role": "assistant", "content": "12 — ünïcode too."}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def masked_runs(rendered) -> list[list[int]]:
    """The contiguous runs of masked token ids."""
    runs, current = [], []
    for token, bit in zip(rendered["input_ids"], rendered["loss_mask"]):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def assert_mask_is_assistant_content(messages, tokenizer, end_of_turn):
    (rendered,) = render(messages, tokenizer, max_length=10_000)
    assert len(rendered["input_ids"]) == len(rendered["loss_mask"])
    assert rendered["input_ids"] == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    expected = [m["content"].strip() + end_of_turn for m in messages if m["role"] == "assistant"]
    assert [tokenizer.decode(run) for run in masked_runs(rendered)] == expected


# --- loading ------------------------------------------------------------------------------------


def test_every_shape_loads_into_messages(tmp_path):
    sharegpt = write_jsonl(
        tmp_path / "share.jsonl",
        [
            {
                "id": "a",
                "conversations": [
                    {"from": "gpt", "value": "...the end of an earlier answer"},
                    {"from": "system", "value": "sys"},
                    {"from": "human", "value": "hi"},
                    {"from": "chatgpt", "value": "hello"},
                    {"from": "user", "value": "more"},
                    {"from": "bard", "value": "sure"},
                ],
            },
            {"conversations": [{"from": "gpt", "value": "only an answer"}]},  # dropped: nothing left
        ],
    )
    listed = tmp_path / "messages.json"
    listed.write_text(json.dumps([{"messages": [Q1, A1]}]))
    mixed = write_jsonl(
        tmp_path / "mixed.data",  # shape is told per record, never by the file name
        [
            {"question": "q?", "answer": "a #### 1"},
            {"instruction": "Sum these.", "input": "1 2", "response": "3"},
            {"instruction": "Say hi.", "input": "", "output": "hi"},
            {"instruction": "Echo.", "output": "Echo."},
        ],
    )
    ds = load_conversations([sharegpt, listed, mixed])
    assert ds.column_names == ["messages", "cut_replies", "tool_calls"] and not any(ds["cut_replies"])
    assert ds["messages"] == [
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "sure"},
        ],
        [Q1, A1],
        [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "a #### 1"}],
        [{"role": "user", "content": "Sum these.\n\n1 2"}, {"role": "assistant", "content": "3"}],
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
        [{"role": "user", "content": "Echo."}, {"role": "assistant", "content": "Echo."}],
    ]


def test_the_shipped_training_files_load_by_their_builtin_names():
    def lines(name: str) -> list[str]:
        with open_text(builtin_path(name)) as f:
            return f.read().splitlines()

    sharegpt = [json.loads(line) for line in lines("sharegpt_1000")]
    with_prompt = sum(any(t["from"] != "gpt" for t in r["conversations"]) for r in sharegpt)
    gsm8k = [json.loads(line) for line in lines("gsm8k_train")]
    codegen = json.loads("\n".join(lines("gpteacher_codegen")))
    ds = load_conversations(list(BUILTIN_TRAIN))
    assert len(ds) == with_prompt + len(gsm8k) + len(codegen) == with_prompt + 7473 + 4535
    assert all(m[0]["role"] != "assistant" for m in ds["messages"][:with_prompt])
    first_gsm = ds[with_prompt]["messages"]
    assert first_gsm == [
        {"role": "user", "content": gsm8k[0]["question"]},
        {"role": "assistant", "content": gsm8k[0]["answer"]},
    ]
    last = ds[len(ds) - 1]["messages"]
    assert last[1] == {"role": "assistant", "content": codegen[-1]["response"]}
    assert last[0]["content"].startswith(codegen[-1]["instruction"])


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "is empty"),
        ("[]", "empty JSON list"),
        (
            '{"question": "q", "answer": "a"}\n{"question": "q", "answer": \n',
            r"bad\.jsonl:2: malformed JSON",
        ),
        (
            '{"question": "q", "answer": "a"}\n{"prompt": "p", "completion": "c"}\n',
            r"record 1 \(line 2\) has keys",
        ),
        ('{"messages": [{"role": "narrator", "content": "x"}]}\n', "unknown role 'narrator'"),
        ('{"conversations": [{"from": "human", "text": "x"}]}\n', "lacks 'value'"),
        ('{"messages": [{"role": "user", "content": null}]}\n', "expected a string"),
        ('["not", "objects"]', "not a JSON object"),
    ],
)
def test_bad_input_errors(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        load_conversations([path])
    assert str(path) in str(err.value)


def test_unknown_shape_names_keys_and_accepted_shapes(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(ValueError) as err:
        load_conversations([path])
    text = str(err.value)
    assert "['completion', 'prompt']" in text and "conversations" in text and "instruction" in text


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_conversations([tmp_path / "nope.jsonl"])


# --- rendering and the loss mask -----------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        [Q1, A1],
        [Q1, A1, Q2, A2],
        [SYSTEM, Q1, A1, Q2, A2],
        [Q1, {"role": "assistant", "content": ""}, Q2, A2],
    ],
    ids=["single", "multi", "system", "empty-reply"],
)
def test_mask_is_assistant_content_chatml(messages):
    assert_mask_is_assistant_content(messages, tiny_tokenizer(), "<|im_end|>")


def test_mask_follows_any_template():
    """A template with no role headers for the reply, trimmed content and a different layout."""
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'A: ' + m['content'] | trim + '<|im_end|>' }}"
        "{% else %}{{ m['role'][0] | upper + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
    )
    padded = {"role": "assistant", "content": "  spaced out  "}
    assert_mask_is_assistant_content([SYSTEM, Q1, padded, Q2, A2], tiny_tokenizer(template), "<|im_end|>")


def test_mask_with_real_smollm2_tokenizer():
    from transformers import AutoTokenizer

    from draftsmith.loading import resolve_model_path

    try:
        path = resolve_model_path("smollm2-135m-instruct")[0]
    except FileNotFoundError as err:
        pytest.skip(str(err))
    tokenizer = AutoTokenizer.from_pretrained(path)
    for messages in ([Q1, A1], [Q1, A1, Q2, A2], [SYSTEM, Q1, A1, Q2, A2]):
        assert_mask_is_assistant_content(messages, tokenizer, "<|im_end|>")
    # the template's default system prompt is context, never a target
    (rendered,) = render([Q1, A1], tokenizer, 10_000)
    unmasked = tokenizer.decode([t for t, m in zip(rendered["input_ids"], rendered["loss_mask"]) if not m])
    assert "SmolLM" in unmasked and A1["content"] not in unmasked


def test_a_cut_reply_is_learned_without_the_end_of_turn_the_template_gave_it():
    """A reply cut at max_new_tokens: its content is a target, the <|im_end|> after it is context only."""
    tok = tiny_tokenizer()
    (whole,) = render([Q1, A1, Q2, A2], tok, 10_000)
    for cut, expected in (
        ([1], [A1["content"], A2["content"] + "<|im_end|>"]),
        ([3], [A1["content"] + "<|im_end|>", A2["content"]]),
        ([1, 3], [A1["content"], A2["content"]]),
    ):
        (rendered,) = render([Q1, A1, Q2, A2], tok, 10_000, cut_replies=cut)
        assert rendered["input_ids"] == whole["input_ids"]  # the context the later turns saw is unchanged
        assert [tok.decode(run) for run in masked_runs(rendered)] == expected


def test_cut_replies_load_with_their_indices_and_an_unclear_old_record_is_skipped(tmp_path, caplog):
    reply = {"source_id": "a:0", "messages": [Q1, A1]}
    cut = {**reply, "source_id": "a:1", "truncated_replies": 1, "cut_replies": [1]}
    old_single = {**reply, "source_id": "a:2", "truncated_replies": 1}  # one reply: it is the cut one
    old_all = {"source_id": "a:3", "messages": [Q1, A1, Q2, A2], "truncated_replies": 2}
    old_unclear = {"source_id": "a:4", "messages": [Q1, A1, Q2, A2], "truncated_replies": 1}
    path = write_jsonl(tmp_path / "regen.jsonl", [reply, cut, old_single, old_all, old_unclear])
    with caplog.at_level(logging.WARNING):
        ds = load_conversations([path])
    assert ds["cut_replies"] == [[], [1], [1], [1, 3]]
    assert "skipped 1 conversations flagged truncated_replies with no cut_replies list" in caplog.text
    rows = build_dataset([path], tok := tiny_tokenizer(), 10_000)
    ends = sorted(sum(t == tok.convert_tokens_to_ids("<|im_end|>") and m for t, m in zip(r["input_ids"], r["loss_mask"]))
                  for r in rows)  # fmt: skip
    assert ends == [0, 0, 0, 1]  # only the uncut reply learns to stop
    bad = write_jsonl(tmp_path / "bad.jsonl", [{**cut, "cut_replies": [0]}])
    with pytest.raises(ValueError, match=r"a:1: cut_replies \[0\] must name assistant messages"):
        load_conversations([bad])


def test_truncation_keeps_mask_aligned():
    tok = tiny_tokenizer()
    (full,) = render([Q1, A1, Q2, A2], tok, 10_000)
    (cut,) = render([Q1, A1, Q2, A2], tok, 40)
    assert cut["input_ids"] == full["input_ids"][:40] and cut["loss_mask"] == full["loss_mask"][:40]


def test_tokenizer_without_chat_template_is_an_error():
    with pytest.raises(
        ValueError, match="no chat template.*--target.chat_template=FILE.*--chat-template FILE"
    ):
        render([Q1, A1], tiny_tokenizer(chat_template=None), 100)


def test_leading_assistant_is_an_error():
    with pytest.raises(ValueError, match="starts with an assistant"):
        render([A1, Q1], tiny_tokenizer(), 100)


# --- dataset, packing, collation -----------------------------------------------------------------


@pytest.fixture
def convo_file(tmp_path):
    records = [
        {"messages": [Q1, {"role": "assistant", "content": f"answer number {i}" * (i % 3 + 1)}]}
        for i in range(9)
    ]
    records.append({"messages": [SYSTEM, Q1]})  # no assistant turn: skipped
    return write_jsonl(tmp_path / "c.jsonl", records)


def test_build_dataset_skips_conversations_without_assistant_tokens(convo_file, capsys):
    ds = build_dataset([convo_file], tiny_tokenizer(), max_length=256)
    assert len(ds) == 9 and set(ds.column_names) == {"input_ids", "loss_mask"}
    said = capsys.readouterr().out  # in the render stage's line
    assert "[draftsmith] data: render + mask: 10 conversations -> 9 rows" in said
    assert "skipped 1 of 10 rendered rows with no assistant tokens" in said
    assert all(any(m) for m in ds["loss_mask"])
    again = build_dataset([convo_file], tiny_tokenizer(), max_length=256)
    other = build_dataset([convo_file], tiny_tokenizer(), max_length=256, seed=1)
    assert ds["input_ids"] == again["input_ids"] and ds["input_ids"] != other["input_ids"]
    assert len(build_dataset([convo_file], tiny_tokenizer(), max_length=256, limit=4)) == 4


def test_packing_keeps_every_token(convo_file):
    tok = tiny_tokenizer()
    plain = build_dataset([convo_file], tok, max_length=128)
    packed = build_dataset([convo_file], tok, max_length=128, pack=True)
    assert len(packed) < len(plain)
    assert all(len(ids) <= 128 for ids in packed["input_ids"])
    pieces = []
    for row in packed:
        assert len(row["input_ids"]) == len(row["loss_mask"]) == len(row["position_ids"])
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            assert row["position_ids"][a:b] == list(range(b - a))
            pieces.append((tuple(row["input_ids"][a:b]), tuple(row["loss_mask"][a:b])))
    assert Counter(pieces) == Counter(zip(map(tuple, plain["input_ids"]), map(tuple, plain["loss_mask"])))


def test_pack_rejects_rows_longer_than_max_length(convo_file):
    ds = build_dataset([convo_file], tiny_tokenizer(), max_length=128)
    with pytest.raises(ValueError, match="longer than max_length"):
        pack_rows(ds, 16)


def test_split_heldout(convo_file):
    ds = build_dataset([convo_file], tiny_tokenizer(), max_length=256)
    train, held = split_heldout(ds, 3, seed=0)
    assert len(train) == 6 and len(held) == 3
    assert Counter(map(tuple, list(train["input_ids"]) + list(held["input_ids"]))) == Counter(
        map(tuple, ds["input_ids"])
    )
    assert len(split_heldout(ds, 0)[1]) == 0
    with pytest.raises(ValueError, match="n_heldout=9"):
        split_heldout(ds, 9)


def test_collate_pads_and_masks():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    batch = collate(rows, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch.input_ids.dtype == torch.long


def test_conversation_files_with_a_byte_order_mark_load(tmp_path):
    record = {"question": "q?", "answer": "a"}
    lines = tmp_path / "bom.jsonl"
    lines.write_bytes(b"\xef\xbb\xbf" + (json.dumps(record) + "\r\n").encode())
    listed = tmp_path / "bom.json"
    listed.write_bytes(b"\xef\xbb\xbf" + json.dumps([record]).encode())
    for path in (lines, listed):
        assert load_conversations([path])["messages"] == [
            [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "a"}]
        ]
