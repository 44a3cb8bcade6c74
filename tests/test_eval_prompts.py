"""Prompt sets for eval: both JSONL formats, filters and order, every bad-input error, rendering."""

from __future__ import annotations

import json

import pytest
from tiny import tiny_tokenizer

from draftsmith.eval.prompts import EvalPrompt, answer_text, load_prompts, read_prompts, render, round_robin


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_spec_bench_two_turn_and_prompt_records(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorten it."]},
            "",  # blank lines are skipped
            {"prompt": "What is 2+2?", "category": "math"},
            {"prompt": "Say hi."},
        ],
    )
    prompts = read_prompts(path)
    assert prompts == [
        EvalPrompt("81", "writing", ("Write a poem.", "Now shorten it.")),
        EvalPrompt("line3", "math", ("What is 2+2?",)),
        EvalPrompt("line4", "default", ("Say hi.",)),
    ]


def test_limit_categories_and_round_robin(tmp_path):
    records = [{"question_id": i, "category": c, "turns": [f"q{i}"]} for i, c in enumerate("aaabbc")]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    assert [p.id for p in load_prompts(path, limit=2)] == ["0", "1"]  # first N in file order
    assert [p.id for p in load_prompts(path, categories=["b", "c"])] == ["3", "4", "5"]
    assert [p.id for p in load_prompts(path, order="round-robin")] == ["0", "3", "5", "1", "4", "2"]
    assert [p.id for p in load_prompts(path, limit=3, order="round-robin")] == ["0", "3", "5"]
    assert round_robin(read_prompts(path)) == load_prompts(path, order="round-robin")
    with pytest.raises(ValueError, match=r"categories z do not occur.*a, b, c"):
        load_prompts(path, categories=["a", "z"])
    with pytest.raises(ValueError, match="--limit must be at least 1"):
        load_prompts(path, limit=0)
    with pytest.raises(ValueError, match="unknown prompt order"):
        load_prompts(path, order="random")


def test_malformed_json_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": "fine"}, '{"prompt": "broken'])
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        read_prompts(path)


def test_record_without_usable_field_lists_accepted_fields(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"question": "2+2?", "answer": "4"}])
    with pytest.raises(ValueError, match=r"p\.jsonl:2: no usable field") as err:
        read_prompts(path)
    message = str(err.value)
    assert "'turns'" in message and "'prompt'" in message and "'question', 'answer'" in message


@pytest.mark.parametrize(
    "record, complaint",
    [
        ({"turns": []}, "'turns' must be a non-empty list"),
        ({"turns": ["ok", 3]}, "'turns' must be a non-empty list"),
        ({"prompt": ""}, "'prompt' must be a non-empty string"),
        ({"prompt": "x", "category": 5}, "'category' must be a non-empty string"),
        (["a", "list"], "expected a JSON object"),
    ],
)
def test_bad_field_values(tmp_path, record, complaint):
    path = write_jsonl(tmp_path / "p.jsonl", [record])
    with pytest.raises(ValueError, match=complaint):
        read_prompts(path)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    for name in ("empty.jsonl", "blank.jsonl"):
        with pytest.raises(ValueError, match="is empty"):
            read_prompts(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl")


def test_render_uses_chat_template_with_generation_prompt():
    tok = tiny_tokenizer()
    ids = render(tok, [{"role": "user", "content": "hi"}])
    text = tok.decode(ids.tolist())
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    second = render(
        tok,
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
        ],
    )
    assert tok.decode(second.tolist()) == text + "hello<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_render_without_template_is_plain_text():
    tok = tiny_tokenizer(chat_template=None)
    assert tok.decode(render(tok, [{"role": "user", "content": "hi there"}]).tolist()) == "hi there"
    conversation = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert tok.decode(render(tok, conversation).tolist()) == "a\n\nb\n\nc"


def test_answer_text_drops_special_tokens():
    tok = tiny_tokenizer()
    ids = tok("the answer")["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert answer_text(tok, ids) == "the answer"


@pytest.mark.parametrize("compress", [False, True])
def test_a_file_with_a_byte_order_mark_and_crlf_lines_reads_as_any_other(tmp_path, compress):
    """Windows editors start UTF-8 files with a BOM and end lines with CRLF; both are read as text."""
    import gzip

    text = '{"prompt": "Ünïcode first", "category": "c"}\r\n{"prompt": "second"}\r\n'
    data = b"\xef\xbb\xbf" + text.encode("utf-8")
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(gzip.compress(data) if compress else data)
    assert [p.turns[0] for p in read_prompts(path)] == ["Ünïcode first", "second"]
