"""``draftsmith shrink-vocab``: a smaller draft vocabulary for a saved EAGLE-3 head, from the command line."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from draftsmith.cli import main
from draftsmith.decode.target import load_target
from draftsmith.drafts.eagle import EagleHead
from draftsmith.train.registry import build_objective


@pytest.fixture()
def setup(tmp_path):
    target_dir = tmp_path / "target"
    tiny_model("llama", layers=4).save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    target = load_target(str(target_dir), device="cpu")
    counts = torch.arange(target.vocab_size).flip(0)
    head = build_objective("eagle3", target, {"draft_vocab_size": 120, "ttt_steps": 2}, counts).build_draft()
    head.save_pretrained(tmp_path / "head")
    data = tmp_path / "convs.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": "spell"}, {"role": "assistant", "content": w}]}
            )
            + "\n"
            for w in ["xylophone", "quiz", "jazz", "kayak"]
        )
    )
    return tmp_path, target_dir, data


def test_cli_writes_a_smaller_head_from_counted_assistant_tokens(setup, capsys):
    tmp_path, _, data = setup
    out = tmp_path / "small"
    assert (
        main(["shrink-vocab", str(tmp_path / "head"), "--size", "30", "--data", str(data), "--out", str(out)])
        == 0
    )
    small, full = EagleHead.from_pretrained(out), EagleHead.from_pretrained(tmp_path / "head")
    assert small.config.draft_vocab_size == 30 and small.lm_head.weight.shape[0] == 30
    record = json.loads((out / "shrink_vocab.json").read_text())
    assert record["draft_vocab_size"] == [120, 30] and record["tokens_counted"] > 0
    # every assistant token the full vocabulary held is still there: they are the most frequent ones
    assert record["coverage"][1] == record["coverage"][0] > 0
    assert set(small.d2t.tolist()) < set(full.d2t.tolist())

    again = ["shrink-vocab", str(tmp_path / "head"), "--size", "20", "--data", str(data), "--out", str(out)]
    assert main(again) == 2 and "nothing was written" in capsys.readouterr().err
    assert EagleHead.from_pretrained(out).config.draft_vocab_size == 30


def test_cli_refuses_another_targets_tokenizer(setup, capsys):
    tmp_path, _, data = setup
    other = tmp_path / "other"
    tiny_model("llama", layers=4).save_pretrained(other)
    tiny_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(
        other
    )
    code = main(
        ["shrink-vocab", str(tmp_path / "head"), "--size", "30", "--data", str(data), "--out",
         str(tmp_path / "x"), "--target", str(other)]
    )  # fmt: skip
    assert code == 2 and "was trained with" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # a draft of another kind (here the target itself, an ordinary causal LM) is named as such
    code = main(
        ["shrink-vocab", str(other), "--size", "30", "--data", str(data), "--out", str(tmp_path / "x")]
    )
    assert code == 2 and "is a distilled small draft (distill)" in capsys.readouterr().err
