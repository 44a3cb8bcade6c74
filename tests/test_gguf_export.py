"""``draftsmith export --to gguf``: distilled Llama drafts as GGUF, read back by transformers' GGUF loader."""

from __future__ import annotations

import pytest
import torch
from tiny import CHATML, tiny_model, tiny_target
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from draftsmith import gguf_export
from draftsmith.cli import main
from draftsmith.decode.target import Target, tokenizer_fingerprint
from draftsmith.drafts import small_lm
from draftsmith.export_verify import ExportVerificationError, verify_export

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Speculative decoding drafts tokens and the target verifies them.",
] * 4
TEXT = "The quick <|im_start|>brown dog<|im_end|> def add(a, b): return a + b"


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with real merges (GGUF's gpt2 tokenizer needs merges), ChatML specials, 300 ids."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|im_start|>", "<|im_end|>", "<pad>"],
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>")
    tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    tokenizer = bpe_tokenizer()
    target = Target(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, "tiny-bpe")
    draft = small_lm.from_config(target, 2, 32, seed=0).eval()
    run = tmp_path_factory.mktemp("run")
    return small_lm.save_draft(draft, tokenizer, target, run / "draft")


def load_back(path):
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def logits(model, ids=((1, 5, 70, 200, 3, 4, 9, 120),)):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


@pytest.mark.parametrize(("dtype", "tol"), [("f32", 1e-6), ("f16", 2e-3), ("q8_0", 2e-2)])
def test_gguf_loads_back_with_the_same_logits_and_tokenizer(draft_dir, tmp_path, dtype, tol):
    original = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(draft_dir)
    path = gguf_export.write_gguf(draft_dir, tmp_path / f"draft-{dtype}.gguf", dtype)
    assert verify_export(path, "gguf")
    model, loaded_tokenizer = load_back(path)
    expected = logits(original)
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=tol * expected.abs().max().item())
    assert loaded_tokenizer(TEXT).input_ids == tokenizer(TEXT).input_ids
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    assert loaded_tokenizer.eos_token == "<|im_end|>"


def test_without_llama_cpp_permutation_the_logits_differ(draft_dir, tmp_path, monkeypatch):
    """The logits check above can fail: q/k written unpermuted are scrambled by the loader's inverse."""
    monkeypatch.setattr(gguf_export, "permute_rows", lambda weight, n_head: weight)
    model, _ = load_back(gguf_export.write_gguf(draft_dir, tmp_path / "raw.gguf", "f32"))
    assert not torch.allclose(
        logits(model), logits(AutoModelForCausalLM.from_pretrained(draft_dir)), atol=1e-4
    )


@pytest.mark.parametrize("how", ["missing", "renamed"])
def test_verifier_refuses_a_gguf_with_a_missing_or_renamed_tensor(draft_dir, tmp_path, monkeypatch, how):
    original = gguf_export.gguf_tensors

    def broken(weights, config):
        tensors = original(weights, config)
        tensor = tensors.pop("blk.1.ffn_up.weight")
        if how == "renamed":
            tensors["blk.1.ffn_upper.weight"] = tensor
        return tensors

    monkeypatch.setattr(gguf_export, "gguf_tensors", broken)
    path = gguf_export.write_gguf(draft_dir, tmp_path / "bad.gguf", "f32")
    with pytest.raises(ExportVerificationError, match="blk.1.ffn_up"):
        verify_export(path, "gguf")


def test_gguf_refuses_other_architectures_and_tokenizers_without_merges(tmp_path):
    qwen = tiny_target("qwen2")
    path = small_lm.save_draft(
        small_lm.from_config(qwen, 1, 32, seed=0), qwen.tokenizer, qwen, tmp_path / "qwen"
    )
    with pytest.raises(ValueError, match="Llama-architecture"):
        gguf_export.write_gguf(path, tmp_path / "q.gguf")
    llama = tiny_target("llama")  # tests/tiny.py's byte tokenizer has no merges
    path = small_lm.save_draft(
        small_lm.from_config(llama, 1, 32, seed=0), llama.tokenizer, llama, tmp_path / "l"
    )
    with pytest.raises(ValueError, match="no merges"):
        gguf_export.write_gguf(path, tmp_path / "l.gguf")


def test_cli_exports_a_gguf_file_and_verifies_it(draft_dir, tmp_path, capsys):
    assert (
        main(
            [
                "export",
                str(draft_dir.parent),
                "--to",
                "gguf",
                "--gguf-dtype",
                "q8_0",
                "--out",
                str(tmp_path / "g"),
            ]
        )
        == 0
    )
    files = list((tmp_path / "g").glob("*.gguf"))
    assert len(files) == 1 and "q8_0" in files[0].name
    assert "matches what the gguf loader reads" in capsys.readouterr().out


@pytest.mark.slow
def test_smollm2_draft_gguf_carries_the_target_tokenizer(tmp_path):
    """A draft of the real bundled target: tokenizer metadata copied from the target's GGUF, fingerprint kept.

    (Logits through the GGUF loader are checked on the tiny drafts above; this one checks the tokenizer.)"""
    from draftsmith.decode.target import load_target, smollm2_gguf_path

    target = load_target("smollm2-135m-instruct", device="cpu")
    draft = small_lm.from_target_layers(target, [0]).eval()
    path = small_lm.save_draft(draft, target.tokenizer, target, tmp_path / "draft")
    gguf_file = gguf_export.write_gguf(path, tmp_path / "d.gguf", "q8_0", smollm2_gguf_path())
    assert verify_export(gguf_file, "gguf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_file.name)
    assert tokenizer_fingerprint(tokenizer) == target.fingerprint()
