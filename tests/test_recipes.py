"""The recipes for real targets start: each runs 2 optimizer steps on a tiny random-init twin of its target.

A twin has the target's architecture (Llama, Qwen3, Qwen3-MoE) with its shapes scaled down (hidden size,
layers, heads, experts, vocabulary, and the draft vocabulary and sequence length with them); everything
else is the recipe's: dtype, precision, packing, mode (online or the offline cache), draft options, loss,
learning-rate schedule, activation checkpointing. The strategy is forced to a single CPU process (the
recipes ask for 8 GPUs) and the data to a small local file (they read the target's regenerated replies).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from tiny import check_validation_tau, tiny_config, tiny_tokenizer
from transformers import AutoModelForCausalLM

from draftsmith.train.config import load_config
from draftsmith.train.loop import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

TWINS = {
    "llama31_8b_eagle3.yaml": ("meta-llama/Llama-3.1-8B-Instruct", "llama"),
    "qwen3_8b_eagle3.yaml": ("Qwen/Qwen3-8B", "qwen3"),
    "qwen3_30b_a3b_eagle3.yaml": ("Qwen/Qwen3-30B-A3B", "qwen3_moe"),
    "qwen3_30b_a3b_eagle3_offline.yaml": ("Qwen/Qwen3-30B-A3B", "qwen3_moe"),
    "llama33_70b_eagle3_offline.yaml": ("meta-llama/Llama-3.3-70B-Instruct", "llama"),
    "qwen3_8b_dflash.yaml": ("Qwen/Qwen3-8B", "qwen3"),
    "llama31_8b_dflash.yaml": ("meta-llama/Llama-3.1-8B-Instruct", "llama"),
}
"""recipe -> (the target it is written for, the architecture of its twin)."""
SCALED = {"draft_vocab_size", "capture_layer_ids"}
"""Draft options the twin cannot take as written: a draft vocabulary of its size, taps among its 4 layers (the
kind's default taps: the recipes' ids run to layer 33)."""

CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
"""The transformers class of each twin, as the real target's config.json names it."""

MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
}
"""Qwen3-30B-A3B's routing (8 of 128 experts, every layer sparse) scaled to 2 of 4 experts."""

MAX_LENGTH, DRAFT_VOCAB = 128, 64
"""The recipes' 2048-4096 tokens and 32000 of ~128-152k draft tokens, scaled to the twin's 259-token vocabulary."""


def save_twin(directory: Path, arch: str) -> Path:
    """A random-init model of ``arch`` with scaled-down shapes and the byte tokenizer, saved where a
    recipe's ``target.spec`` can point."""
    overrides = {**(MOE if arch == "qwen3_moe" else {}), "max_position_embeddings": MAX_LENGTH}
    AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def write_conversations(path: Path, n: int = 48) -> Path:
    """Multi-turn ShareGPT records, enough for the recipe's packed rows, grad_accum and held-out split."""
    rows = [
        {"conversations": [
            {"from": "human", "value": f"count from {i}"}, {"from": "gpt", "value": " ".join(map(str, range(i, i + 6)))},
            {"from": "human", "value": "and back?"}, {"from": "gpt", "value": " ".join(map(str, range(i + 5, i - 1, -1)))},
        ]}
        for i in range(n)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def real_target_recipes() -> list[str]:
    """Every shipped recipe written for a target other than the bundled SmolLM2."""
    names = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        spec = (yaml.safe_load(path.read_text()).get("target") or {}).get("spec", "smollm2-135m-instruct")
        if "smollm2" not in spec.lower():
            names.append(path.name)
    return names


def test_every_real_target_recipe_has_a_twin():
    """A new recipe for a real target must be added to TWINS, or CI would never start it."""
    assert real_target_recipes() == sorted(TWINS)


@pytest.mark.parametrize("recipe", sorted(TWINS))
def test_recipe_starts_on_its_tiny_twin(tmp_path, recipe):
    spec, arch = TWINS[recipe]
    as_shipped = load_config(CONFIGS / recipe)
    assert as_shipped.target.spec == spec and as_shipped.draft.kind in ("eagle3", "dflash")
    eagle, own_vocab = as_shipped.draft.kind == "eagle3", "draft_vocab_size" in as_shipped.draft.options
    twin = save_twin(tmp_path / "twin", arch)
    twin_config = json.loads((twin / "config.json").read_text())
    assert twin_config["architectures"] == [CLASSES[arch]]
    data = write_conversations(tmp_path / "convs.jsonl")
    config = load_config(
        CONFIGS / recipe,
        [f"--target.spec={twin}", f"--data.paths=[{data}]", "--data.regenerated=null", "--data.limit=null",
         "--data.heldout=4", f"--data.max_length={MAX_LENGTH}",
         *([f"--draft.options.draft_vocab_size={DRAFT_VOCAB}"] if own_vocab else []),
         *([] if eagle else ["--draft.options.capture_layer_ids=null"]),
         f"--cache.dir={tmp_path / 'cache'}", f"--output.dir={tmp_path / 'run'}",
         # a single CPU process in place of the recipe's 8 GPUs
         "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=auto", "--trainer.num_workers=0",
         "--trainer.max_steps=2", "--trainer.val_every=2", "--trainer.batch_size=2"],
    )  # fmt: skip
    # the twin runs the recipe's dtype, precision, packing, mode, optimizer, accumulation and checkpointing
    assert (config.target, config.optim, config.mode, config.data.pack) == (
        dataclasses.replace(as_shipped.target, spec=str(twin)), as_shipped.optim,
        as_shipped.mode, as_shipped.data.pack,
    )  # fmt: skip
    t, shipped = config.trainer, as_shipped.trainer
    assert (t.precision, t.grad_accum, t.activation_checkpointing, t.val_k) == (
        shipped.precision,
        shipped.grad_accum,
        shipped.activation_checkpointing,
        shipped.val_k,
    )
    assert {k: v for k, v in config.draft.options.items() if k not in SCALED} == {
        k: v for k, v in as_shipped.draft.options.items() if k not in SCALED
    }

    result = train(config, enable_progress_bar=False)

    assert result.steps == 2
    check_validation_tau(result, config.trainer.val_k)
    head = json.loads((result.draft_dir / "config.json").read_text())
    layers = head["num_decoder_layers"] if eagle else head["num_hidden_layers"]
    vocab = DRAFT_VOCAB if own_vocab else twin_config["vocab_size"]  # none: the target's LM head, all of it
    assert head["draft_vocab_size"] == vocab and layers == as_shipped.draft.options["num_layers"]
    if config.mode == "offline":
        assert any((tmp_path / "cache").rglob("*.safetensors")), "the offline recipe filled its feature cache"


def test_every_shipped_eagle3_recipe_trains_the_default():
    """The EAGLE-3 default (BENCHMARKS.md, "The EAGLE-3 recipe"): Muon and the three EAGLE-3.1 norms, in every
    shipped EAGLE-3 recipe but the debug one (a path check exported to every engine); a fine-tuning recipe gets
    the norms from the head it continues."""
    for path in sorted(CONFIGS.glob("*.yaml")):
        config = load_config(path)
        if config.draft.kind != "eagle3" or path.name.startswith("debug_"):
            continue
        assert config.optim.name == "muon", path.name
        options = config.draft.options
        if options.get("init_from"):
            continue
        assert all(options.get(key) for key in ("norm_before_fc", "norm_output", "norm_before_residual")), (
            path.name
        )
