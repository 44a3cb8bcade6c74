"""``draftsmith data regenerate``: the target's own replies, written resumably."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from draftsmith.cli import build_parser, main
from draftsmith.loading import load_causal_lm
from draftsmith.train.corpus.prompts import read_done
from draftsmith.train.corpus.regenerate import regenerate
from draftsmith.train.corpus.tokens import chat_text

MAX_NEW = 6


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-target")
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    model, tokenizer, _ = load_causal_lm(str(target_dir), device="cpu")
    return model, tokenizer


@pytest.fixture
def data(tmp_path):
    records = [{"question": f"What is {i}+{i}?", "answer": f"{2 * i}"} for i in range(5)] + [
        {
            "conversations": [
                {"from": "gpt", "value": "tail of an older answer"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
                {"from": "gpt", "value": "and more"},
                {"from": "human", "value": "bye?"},
            ]
        }
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def greedy_reply(model, tokenizer, messages) -> tuple[str, bool]:
    """The reference: one prompt alone, no padding, greedy, cut at the end-of-turn token; and whether it
    ended there (False: it ran to MAX_NEW tokens)."""
    ids = tokenizer(chat_text(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)[
        "input_ids"
    ]
    out = model.generate(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id],
    )[0, len(ids) :].tolist()
    finished = tokenizer.eos_token_id in out
    if finished:
        out = out[: out.index(tokenizer.eos_token_id)]
    return tokenizer.decode(out, skip_special_tokens=True), finished


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_replies_are_the_targets_own(target, data, tmp_path, batching):
    model, tokenizer = target
    out = tmp_path / "out.jsonl"
    stats = regenerate(
        model, tokenizer, [data], out, max_new_tokens=MAX_NEW, batch_size=4, progress=False, batching=batching
    )
    records = {r["source_id"]: r for r in lines(out)}
    assert stats.written == len(records) == 6 and stats.already_done == 0
    cut = {}
    for i in range(5):
        messages = records[f"train.jsonl:{i}"]["messages"]
        assert messages[0] == {"role": "user", "content": f"What is {i}+{i}?"}
        assert [m["role"] for m in messages] == ["user", "assistant"]
        reply, finished = greedy_reply(model, tokenizer, messages[:1])
        assert messages[1]["content"] == reply
        cut[f"train.jsonl:{i}"] = not finished
    # leading assistant turn dropped, two assistant turns in a row answered once, trailing user answered
    chat = records["train.jsonl:5"]["messages"]
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
    assert [chat[0]["content"], chat[2]["content"]] == ["hi", "bye?"]
    (first, first_ended), (second, second_ended) = (greedy_reply(model, tokenizer, chat[:n]) for n in (1, 3))
    assert [chat[1]["content"], chat[3]["content"]] == [first, second]
    cut["train.jsonl:5"] = not (first_ended and second_ended)
    assert stats.replies == 7
    assert len({records[f"train.jsonl:{i}"]["messages"][1]["content"] for i in range(5)} - {""}) > 1
    # a reply that ran to max_new_tokens is flagged, and only those, by its message index
    assert {sid: bool(r.get("truncated_replies")) for sid, r in records.items()} == cut
    expected = {f"train.jsonl:{i}": [1] if cut[f"train.jsonl:{i}"] else [] for i in range(5)}
    expected["train.jsonl:5"] = [i for i, ended in ((1, first_ended), (3, second_ended)) if not ended]
    assert {sid: r.get("cut_replies", []) for sid, r in records.items()} == expected
    assert stats.truncated_replies == sum(not e for e in (first_ended, second_ended)) + sum(
        cut[f"train.jsonl:{i}"] for i in range(5)
    )


def test_resume_skips_done_records_and_appends(target, data, tmp_path):
    model, tokenizer = target
    out = tmp_path / "out.jsonl"
    regenerate(model, tokenizer, [data], out, max_new_tokens=MAX_NEW, limit=2, progress=False)
    assert sorted(r["source_id"] for r in lines(out)) == ["train.jsonl:0", "train.jsonl:1"]
    again = regenerate(model, tokenizer, [data], out, max_new_tokens=MAX_NEW, limit=2, progress=False)
    assert again.written == 0 and again.already_done == 2 and len(lines(out)) == 2
    more = regenerate(model, tokenizer, [data], out, max_new_tokens=MAX_NEW, progress=False)
    ids = [r["source_id"] for r in lines(out)]
    assert more.written == 4 and more.already_done == 2
    assert sorted(ids) == [f"train.jsonl:{i}" for i in range(6)]


def test_partial_last_line_is_dropped_and_redone(target, data, tmp_path):
    model, tokenizer = target
    out = tmp_path / "out.jsonl"
    regenerate(model, tokenizer, [data], out, max_new_tokens=MAX_NEW, limit=3, progress=False)
    data_bytes = out.read_bytes()
    last_line = len(data_bytes.splitlines()[-1]) + 1
    out.write_bytes(data_bytes[: len(data_bytes) - last_line // 2])  # the last record half written
    assert len(read_done(out)) == 2  # and the partial line is gone from the file
    assert out.read_text().endswith("\n")
    stats = regenerate(model, tokenizer, [data], out, max_new_tokens=MAX_NEW, limit=3, progress=False)
    assert stats.written == 1
    assert sorted(r["source_id"] for r in lines(out)) == ["train.jsonl:0", "train.jsonl:1", "train.jsonl:2"]


def test_damaged_middle_line_is_an_error(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"source_id": "a:0", "messages": []}\nnot json\n{"source_id": "a:1", "messages": []}\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_done(out)


def test_long_prompt_stops_the_conversation(target, data, tmp_path):
    model, tokenizer = target
    out = tmp_path / "out.jsonl"
    first_prompt = len(
        tokenizer(chat_text(tokenizer, [{"role": "user", "content": "hi"}], True))["input_ids"]
    )
    stats = regenerate(
        model,
        tokenizer,
        [data],
        out,
        max_new_tokens=MAX_NEW,
        max_prompt_tokens=first_prompt + 3,
        progress=False,
    )
    chat = next(r for r in lines(out) if r["source_id"] == "train.jsonl:5")
    assert chat["prompt_too_long"] and [m["role"] for m in chat["messages"]] == ["user", "assistant"]
    assert stats.cut_conversations >= 1


def test_cli_regenerate(target_dir, data, tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    args = ["data", "regenerate", "--target", str(target_dir), "--data", str(data), "--out", str(out)]
    assert main([*args, "--max-new-tokens", "4", "--limit", "2", "--device", "cpu"]) == 0
    assert len(lines(out)) == 2 and "wrote 2 conversations" in capsys.readouterr().out
    assert main([*args, "--max-new-tokens", "4", "--limit", "2", "--device", "cpu"]) == 0
    assert len(lines(out)) == 2 and "2 were already there" in capsys.readouterr().out


def test_cli_help_text(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser("data").parse_args(["data", "regenerate", "--help"])
    text = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "Self-distillation" in text and "Resumable" in text and "--max-new-tokens" in text


def test_cli_prompts_interleave_files_and_keep_first_user_turns(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.json"
    a.write_text(
        "".join(
            json.dumps(
                {"conversations": [{"from": "human", "value": f"a{i}"}, {"from": "gpt", "value": "x"}]}
            )
            + "\n"
            for i in range(3)
        )
    )
    b.write_text(json.dumps([{"question": "b0", "answer": "y"}, {"question": "b" * 50, "answer": "z"}]))
    out = tmp_path / "p" / "prompts.jsonl"
    argv = ["data", "prompts", "--data", str(a), str(b), "--out", str(out), "--max-chars", "10"]
    assert main([*argv, "--count", "9"]) == 0
    rows = lines(out)
    assert [r["id"] for r in rows] == ["a.jsonl:0", "b.json:0", "a.jsonl:1", "a.jsonl:2"]  # b's 2nd too long
    assert [r["messages"] for r in rows[:2]] == [
        [{"role": "user", "content": "a0"}],
        [{"role": "user", "content": "b0"}],
    ]
    assert "(the files hold only 4)" in capsys.readouterr().out
    assert main([*argv, "--count", "0"]) == 2 and "--count" in capsys.readouterr().err
    # a second batch leaves out what the first one holds
    more = tmp_path / "p" / "more.jsonl"
    second = ["data", "prompts", "--data", str(a), str(b), "--out", str(more), "--count", "9"]
    assert main([*second, "--max-chars", "10", "--exclude", str(out)]) == 0
    assert lines(more) == [] and "left out 4 prompts" in capsys.readouterr().out
    assert main([*second, "--exclude", str(out)]) == 0
    assert [r["id"] for r in lines(more)] == ["b.json:1"]
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n')
    assert main([*second, "--exclude", str(bad)]) == 2
    assert 'line 1 has no "id"; fix or delete that line, or pass to --exclude' in capsys.readouterr().err
