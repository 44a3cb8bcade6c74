"""A preallocated (static) KV cache for the target, and torch.compile of its decode steps."""

from __future__ import annotations

import json

import pytest
import torch
from test_decode import no_eos, prompt
from tiny import tiny_model, tiny_target, tiny_tokenizer
from transformers import StaticCache

from draftsmith.cli import main
from draftsmith.decode.speculative import generate
from draftsmith.drafts import build_drafter
from draftsmith.drafts.eagle import EagleConfig, EagleHead
from draftsmith.drafts.eagle_drafter import EagleDrafter

NEW = 40


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_static_cache_decoding_equals_dynamic(arch):
    target = no_eos(tiny_target(arch, layers=6))
    reference = generate(target, prompt(), None, max_new_tokens=NEW).tokens
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target, "eagle3", draft_vocab_size=120)).eval()
    head.init_from_target(target.model)
    target.use_static_cache(prompt().numel() + NEW + 8)
    assert generate(target, prompt(), None, max_new_tokens=NEW).tokens == reference
    for drafter in (build_drafter("layers:2", target), build_drafter("ngram", target), EagleDrafter(head)):
        for k in (1, 4, "auto"):
            result = generate(target, prompt(), drafter, k=k, max_new_tokens=NEW)
            assert result.tokens == reference, (drafter.name, k)
    assert target.length == prompt().numel() + NEW - 1
    buffers = target.cache.layers[0].keys.data_ptr()
    generate(target, prompt(1), None, max_new_tokens=5)
    assert target.cache.layers[0].keys.data_ptr() == buffers  # reused across generations


def test_static_cache_errors():
    target = tiny_target("llama")
    target.use_static_cache(16)
    with pytest.raises(ValueError, match="static KV cache holds 16 positions, but this step needs"):
        generate(target, prompt(), None, max_new_tokens=NEW)
    with pytest.raises(ValueError, match="at least 2 positions"):
        target.use_static_cache(1)
    with pytest.raises(ValueError, match="cannot be rolled back"):
        tiny_target("gemma2").use_static_cache(64)
    with pytest.raises(ValueError, match="needs a static KV cache"):
        tiny_target("llama").compile()


@pytest.mark.slow
def test_compiled_decode_steps_keep_greedy_output():
    target = no_eos(tiny_target("llama"))
    reference = generate(target, prompt(), None, max_new_tokens=20).tokens
    drafter = build_drafter("layers:2", target)
    for model in (target, drafter):  # the target's verify steps and the draft's steps
        model.use_static_cache(64)
        model.compile()
    for _ in range(2):  # the second pass reuses the compiled graphs
        result = generate(target, prompt(), drafter, k=3, max_new_tokens=20)
        assert result.tokens == reference
    assert sum(result.accepted) > 0
    assert isinstance(drafter.cache, StaticCache)


def test_draft_static_cache_equals_dynamic():
    target = no_eos(tiny_target("qwen2", layers=6))
    reference = generate(target, prompt(), None, max_new_tokens=NEW).tokens
    drafter = build_drafter("layers:3", target)
    dynamic = generate(target, prompt(), drafter, k=4, max_new_tokens=NEW)
    drafter.use_static_cache(prompt().numel() + NEW + 8)
    static = generate(target, prompt(), drafter, k=4, max_new_tokens=NEW)
    assert static.tokens == dynamic.tokens == reference
    assert static.accepted == dynamic.accepted  # the draft proposed exactly the same tokens
    with pytest.raises(ValueError, match="needs a static KV cache"):
        build_drafter("layers:2", target).compile()


def test_eval_cli_static_cache(tmp_path):
    model = tmp_path / "model"
    tiny_model("llama").save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["abc abc abc", "and again"], "category": "chat"}) + "\n")
    argv = ["eval", "--target", str(model), "--draft", "ngram", "--prompts", str(prompts)]
    argv += ["--max-new-tokens", "12", "--warmup", "0", "--static-cache", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["settings"]["static_cache"] is True and report["drafts"][0]["exact_match"] is True
    assert main([*argv, "--tree", "3,2,4"]) == 2
