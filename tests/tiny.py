"""Tiny random-init targets and a byte-level chat tokenizer for fast CPU tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
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


def tiny_target(arch: str = "llama", seed: int = 0, **overrides):
    from draftsmith.decode.target import Target

    return Target(tiny_model(arch, seed, **overrides), tiny_tokenizer(), f"tiny-{arch}")
