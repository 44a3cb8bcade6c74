"""Tiny random-init targets and a byte-level chat tokenizer for fast CPU tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text"]


def tiny_tokenizer(chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: 256 byte tokens plus <|im_start|>, <|im_end|>, <pad> (vocab 259)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "pad_token": "<pad>"}
    )
    tok.eos_token = "<|im_end|>"
    tok.chat_template = chat_template
    return tok


BPE_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Speculative decoding drafts tokens and the target verifies them.",
] * 4


def tiny_bpe_tokenizer() -> PreTrainedTokenizerFast:
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
    backend.train_from_iterator(BPE_CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>")
    tokenizer.chat_template = CHATML
    return tokenizer


def tiny_config(arch: str = "llama", vocab_size: int = 259, layers: int = 4, hidden: int = 32, **overrides):
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    if arch in ("gemma2", "gemma3_text", "mistral"):
        kwargs["sliding_window"] = 16  # shorter than the tests' sequences: exercises sliding-window caches
    if arch == "gemma3_text":
        kwargs["sliding_window_pattern"] = 2
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    # random init gives near-uniform logits; sharpen them so greedy paths are not decided by rounding
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model.eval()


def save_tiny_model(path, arch: str = "llama", seed: int = 0):
    """A tiny model and the byte tokenizer saved to ``path``: a model directory the CLI can load."""
    tiny_model(arch, seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def tiny_target(arch: str = "llama", seed: int = 0, **overrides):
    from draftsmith.decode.target import Target

    return Target(tiny_model(arch, seed, **overrides), tiny_tokenizer(), f"tiny-{arch}")


def train_debug_recipe(tmp_path, recipe: str, *overrides: str, layers: int = 4):
    """``configs/<recipe>`` through the one loop for 2 steps on a tiny saved Llama target and 12 counting
    conversations (the recipe's draft options kept); returns the loop's result and the config it ran."""
    import json

    from draftsmith.train.config import load_config
    from draftsmith.train.loop import train

    target_dir, data = tmp_path / "target", tmp_path / "convs.jsonl"
    tiny_model("llama", layers=layers).save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    turns = [[{"from": "human", "value": f"count from {i}"}, {"from": "gpt", "value": f"{i} {i + 1} {i + 2}"}]
             for i in range(12)]  # fmt: skip
    data.write_text("".join(json.dumps({"conversations": t}) + "\n" for t in turns))
    config = load_config(
        f"configs/{recipe}",
        [f"--target.spec={target_dir}", f"--data.paths=[{data}]", f"--output.dir={tmp_path / 'run'}",
         "--trainer.max_steps=2", "--trainer.val_every=2", "--trainer.batch_size=4", *overrides],
    )  # fmt: skip
    result = train(config, enable_progress_bar=False)
    assert result.steps == 2
    check_validation_tau(result, config.trainer.val_k)
    return result, config


def check_validation_tau(result, val_k: int) -> None:
    """The run's final τ and α are those of the acceptance histogram its exported draft records (entry j:
    verify steps of the held-out walk that accepted j of ``val_k`` drafted tokens), computed here from the
    definitions, and that histogram counts some steps: a τ made up, mis-derived or measured on nothing fails."""
    import json

    import pytest

    state = json.loads((result.draft_dir / "train_state.json").read_text())
    histogram = state["histogram"]
    steps = sum(histogram)
    accepted = sum(j * n for j, n in enumerate(histogram))
    assert state["step"] == result.steps and len(histogram) == val_k + 1 and steps > 0, state
    assert result.val["tau"] == pytest.approx(1 + accepted / steps, abs=1e-9)
    assert result.val["alpha"] == pytest.approx(accepted / (val_k * steps), abs=1e-9)


def tiny_bpe_target_gguf(root):
    """An 8-layer tiny Llama target on ``tiny_bpe_tokenizer`` and its F32 GGUF (written under ``root``):
    the same model for transformers and for llama.cpp."""
    from draftsmith.decode.target import Target
    from draftsmith.export.gguf import write_gguf

    tokenizer = tiny_bpe_tokenizer()
    target = Target(tiny_model("llama", vocab_size=len(tokenizer), layers=8), tokenizer, "tiny-bpe")
    target.model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return target, write_gguf(root / "target", root / "target.gguf", "f32")
