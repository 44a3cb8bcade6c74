"""bfloat16 where it is fast: ``dtype: auto`` / ``precision: auto``, and the LM-head input fix that makes
a bf16 CPU ``generate`` usable. Tiny models, CPU; the machine's own flags are replaced where it matters."""

from __future__ import annotations

import json

import pytest
import torch
from test_loop import conversations, make_config, tiny_target_dir  # noqa: F401 (fixtures)
from tiny import tiny_model, tiny_tokenizer

from draftsmith import loading as target_mod
from draftsmith.loading import bf16_is_fast, load_causal_lm, resolve_dtype
from draftsmith.train.infra.distributed import resolve_auto_precision
from draftsmith.train.loop import train


@pytest.fixture
def cpu_with(monkeypatch):
    """Pretend this CPU reports the given feature flags."""

    def set_flags(*flags: str) -> None:
        monkeypatch.setattr(target_mod, "cpu_flags", lambda: frozenset(flags))

    return set_flags


@pytest.mark.parametrize(
    "flags, fast",
    [(("avx512f", "amx_bf16", "amx_tile"), True), (("avx512_bf16",), True), (("avx2", "avx512f"), False)],
)
def test_auto_dtype_follows_the_cpus_bf16_instructions(cpu_with, flags, fast):
    cpu_with(*flags)
    assert bf16_is_fast("cpu") is fast
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if fast else torch.float32)
    assert resolve_dtype("float32", "cpu") == torch.float32  # an explicit dtype is never changed


def test_auto_dtype_needs_a_device_and_unknown_names_are_listed():
    with pytest.raises(ValueError, match="needs the device"):
        resolve_dtype("auto")
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        resolve_dtype("bf16", "cpu")


@pytest.mark.parametrize("fast", [True, False])
def test_auto_precision_resolves_trainer_and_target_together(cpu_with, fast, tmp_path):
    cpu_with(*(("amx_bf16",) if fast else ()))
    config = make_config(
        tmp_path, tmp_path / "d.jsonl", tmp_path / "o", "--trainer.precision=auto", "--target.dtype=auto"
    )
    resolved = resolve_auto_precision(config)
    assert resolved.trainer.precision == ("bf16-mixed" if fast else "32-true")
    assert resolved.target.dtype == ("bfloat16" if fast else "float32")
    explicit = make_config(tmp_path, tmp_path / "d.jsonl", tmp_path / "o", "--trainer.precision=32-true")
    assert resolve_auto_precision(explicit) == explicit


def test_auto_precision_trains_in_bf16_where_it_is_fast(cpu_with, tiny_target_dir, conversations, tmp_path):  # noqa: F811
    cpu_with("amx_bf16")
    out = tmp_path / "run"
    config = make_config(
        tiny_target_dir, conversations, out, "--trainer.max_steps=3", "--trainer.val_every=3",
        "--trainer.precision=auto", "--target.dtype=auto",
    )  # fmt: skip
    result = train(config, enable_progress_bar=False)
    assert result.steps == 3 and torch.isfinite(torch.tensor(result.val["tau"]))
    recorded = (out / "config.yaml").read_text()
    assert "precision: bf16-mixed" in recorded and "dtype: bfloat16" in recorded  # what ran, not "auto"
    assert json.loads((out / "draft" / "train_state.json").read_text())["step"] == 3


def test_lm_head_gets_a_contiguous_input(tmp_path):
    """generate() scores the prompt's last position through a strided view; the loaded model's LM head
    must see it contiguous (pytorch/pytorch#151934: the strided bf16 path copies the weight per row)."""
    tiny_model("llama").save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model, tokenizer, _ = load_causal_lm(str(tmp_path), "cpu", "float32")
    seen = []
    model.get_output_embeddings().register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous())
    )
    hidden = torch.randn(3, 7, model.config.hidden_size)
    strided = hidden[:, -1:, :]
    assert not strided.is_contiguous()
    with torch.no_grad():
        out = model.get_output_embeddings()(strided)
        torch.testing.assert_close(out, model.get_output_embeddings()(hidden[:, -1:, :].contiguous()))
        ids = tokenizer(["abc", "a longer prompt"], return_tensors="pt", padding=True)
        model.generate(**ids, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert seen and all(seen)
