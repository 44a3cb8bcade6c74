"""``draftsmith data synthesize``: prompts the target writes itself, kept only when the request ends."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from draftsmith.cli import main
from draftsmith.train.corpus.generate import generate_replies
from draftsmith.train.corpus.synthesize import synthesize, user_turn_prefix

EOS = 258  # <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama").eval()
    with torch.no_grad():  # an end-of-turn token now and then, so some requests end in time
        model.lm_head.weight[EOS] *= 4
    tokenizer = tiny_tokenizer()
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return model, tokenizer


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_user_turn_prefix_is_the_template_before_the_users_words():
    tok = tiny_tokenizer()
    assert user_turn_prefix(tok) == "<|im_start|>user\n"
    assert (
        user_turn_prefix(tok, system="Be brief.")
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    )
    with pytest.raises(ValueError, match="has no chat template"):
        user_turn_prefix(tiny_tokenizer(chat_template=None))
    upper = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] | upper }}{% endfor %}"
    with pytest.raises(ValueError, match="does not render the user's message verbatim"):
        user_turn_prefix(tiny_tokenizer(chat_template=upper))


def test_keeps_exactly_the_requests_that_end_in_time(target, tmp_path):
    model, tok = target
    assert EOS == tok.convert_tokens_to_ids("<|im_end|>")
    out = tmp_path / "prompts.jsonl"
    stats = synthesize(
        model,
        tok,
        out,
        count=100,
        max_new_tokens=24,
        batch_size=16,
        min_chars=3,
        max_batches=1,
        progress=False,
    )
    # the same batch, sampled again from the batch's seed: what should have been kept
    torch.manual_seed(0)
    prefix = tok(user_turn_prefix(tok), add_special_tokens=False)["input_ids"]
    replies = generate_replies(model, [prefix] * 16, tok.pad_token_id, [EOS], 24, 1.0)
    expected, seen = [], set()
    for n, (ids, finished) in enumerate(replies):
        text = tok.decode(ids, skip_special_tokens=True).strip()
        if finished and len(text) >= 3 and text not in seen:
            seen.add(text)
            expected.append({"id": f"synthesized:0:0:{n}", "messages": [{"role": "user", "content": text}]})
    assert lines(out) == expected
    assert 0 < len(expected) < 16  # some requests ended and some ran on: both paths are exercised
    assert stats.sampled == 16 and stats.written == len(expected)
    assert stats.unfinished == sum(not finished for _, finished in replies) > 0


def test_resumes_to_the_same_records(target, tmp_path):
    model, tok = target
    kwargs = dict(max_new_tokens=24, batch_size=8, min_chars=1, progress=False)
    whole = tmp_path / "whole.jsonl"
    synthesize(model, tok, whole, count=6, **kwargs)
    assert len(lines(whole)) == 6
    resumed = tmp_path / "resumed.jsonl"
    synthesize(model, tok, resumed, count=2, **kwargs)
    first = lines(resumed)
    stats = synthesize(model, tok, resumed, count=6, **kwargs)
    assert stats.already_done == 2 and lines(resumed)[:2] == first
    assert lines(resumed) == lines(whole)
    ids = [r["id"] for r in lines(whole)]
    assert len(set(ids)) == len(ids)


def test_cli_writes_prompts_and_refuses_bad_counts(target, tmp_path, capsys):
    model, tok = target
    target_dir = tmp_path / "target"
    model.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    out = tmp_path / "p.jsonl"
    argv = ["data", "synthesize", "--target", str(target_dir), "--out", str(out), "--max-new-tokens", "24"]
    assert main([*argv, "--count", "3", "--batch-size", "8", "--min-chars", "1"]) == 0
    text = capsys.readouterr().out
    assert len(lines(out)) == 3 and "wrote 3 prompts" in text and "unfinished" in text
    assert main([*argv, "--count", "0"]) == 2 and "count (0)" in capsys.readouterr().err
