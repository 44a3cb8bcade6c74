"""Small causal-LM drafts: built from the target, trained with LoRA, saved and decoded losslessly."""

import json

import pytest
import torch
from tiny import tiny_model, tiny_target, tiny_tokenizer
from transformers import AutoModelForCausalLM

from draftsmith.decode.features import decoder_layers
from draftsmith.decode.speculative import generate
from draftsmith.drafts import build_drafter, distill

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 120, 33, 8, 201]])


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_all_target_layers_reproduce_the_target_with_copied_weights(arch):
    target = tiny_target(arch)
    draft = distill.from_target_layers(target, list(range(4)))
    assert torch.equal(_logits(draft.eval()), _logits(target.model))
    ours = dict(draft.named_parameters())
    for name, weight in target.model.named_parameters():
        assert ours[name].data_ptr() != weight.data_ptr()
        assert ours[name].requires_grad and not weight.requires_grad
    before = target.model.get_input_embeddings().weight.clone()
    with torch.no_grad():
        draft.get_input_embeddings().weight.add_(1.0)
    assert torch.equal(target.model.get_input_embeddings().weight, before)


def test_layer_subset_copies_the_chosen_layers():
    target = tiny_target("gemma3_text")
    draft = distill.from_target_layers(target, [0, -1])  # a sliding and a full-attention layer
    layers = decoder_layers(draft)
    assert len(layers) == 2 and draft.config.num_hidden_layers == 2
    assert draft.config.layer_types == [target.config.layer_types[0], target.config.layer_types[3]]
    source = decoder_layers(target.model)
    for mine, theirs in zip(layers, (source[0], source[3])):
        for (name, a), (_, b) in zip(mine.state_dict().items(), theirs.state_dict().items()):
            assert torch.equal(a, b), name
    assert torch.equal(draft.lm_head.weight, target.model.lm_head.weight)
    assert _logits(draft.eval()).shape == (1, IDS.shape[1], target.vocab_size)
    with pytest.raises(ValueError, match="layer ids"):
        distill.from_target_layers(target, [4])


def test_from_config_builds_a_narrower_model_of_the_same_kind():
    target = tiny_target("qwen3")
    draft = distill.from_config(target, num_layers=2, hidden_size=16)
    cfg = draft.config
    assert cfg.model_type == "qwen3" and cfg.vocab_size == target.vocab_size
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size) == (
        2,
        16,
        2,
        32,
    )
    assert cfg.head_dim == target.config.head_dim and cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert _logits(draft.eval()).shape == (1, IDS.shape[1], target.vocab_size)
    with pytest.raises(ValueError, match="head size"):
        distill.from_config(target, num_layers=1, hidden_size=20)


def _train_step(model, lr=1e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    out = model(input_ids=IDS, labels=IDS)
    out.loss.backward()
    opt.step()


def test_lora_trains_only_adapters_and_merges_to_the_same_logits():
    target = tiny_target("llama")
    model = distill.apply_lora(distill.from_target_layers(target, [0, 3]), r=4, alpha=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train_step(model)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_B" in n for n in changed)  # B starts at zero: the adapter now changes the output
    model.eval()
    import copy

    merged = copy.deepcopy(model).merge_and_unload()
    torch.testing.assert_close(_logits(merged), _logits(model), rtol=1e-4, atol=1e-4)


def _assert_decodes_losslessly(directory, target):
    drafter = build_drafter(str(directory), target)
    prompt = IDS[0, :6]
    plain = generate(target, prompt, None, max_new_tokens=12)
    spec = generate(target, prompt, drafter, k=3, max_new_tokens=12)
    assert spec.tokens == plain.tokens
    assert sum(spec.accepted) > 0  # a draft copied from the target agrees with it


def test_save_draft_loads_as_an_ordinary_causal_lm(tmp_path):
    target = tiny_target("llama")
    draft = distill.from_target_layers(target, [0, 1, 2])
    out = distill.save_draft(draft, target.tokenizer, target, tmp_path / "draft")
    config = json.loads((out / "config.json").read_text())
    assert config[distill.TARGET_KEY] == target.record()
    assert config["draftsmith_kind"] == "distill"  # its kind, beside the keys transformers reads
    assert (out / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(_logits(loaded.eval()), _logits(draft.eval()))
    _assert_decodes_losslessly(out, target)
    # saving again replaces the directory whole and leaves no temporary directories behind
    distill.save_draft(distill.from_target_layers(target, [0]), target.tokenizer, target, out)
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


@pytest.mark.parametrize("merge", [True, False])
def test_save_lora_draft_merged_or_as_adapter(tmp_path, merge):
    target = tiny_target("llama")
    model = distill.apply_lora(distill.from_target_layers(target, [0, 1, 2, 3]), r=4, alpha=8)
    _train_step(model, lr=1e-3)
    out = distill.save_draft(model, target.tokenizer, target, tmp_path / "draft", merge=merge)
    assert (out / "adapter_config.json").exists() is not merge
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(loaded), _logits(model.eval()), rtol=1e-4, atol=1e-4)
    assert "lora_A" in str(dict(model.named_parameters()).keys())  # the trained model was not altered
    _assert_decodes_losslessly(out, target)


def test_from_pretrained_draft_checks_the_vocabulary(tmp_path):
    target = tiny_target("llama")
    distill.save_draft(distill.from_config(target, 1, 16), target.tokenizer, target, tmp_path / "ok")
    draft = distill.from_pretrained_draft(str(tmp_path / "ok"), target)
    assert draft.training and all(p.requires_grad for p in draft.parameters())

    other = tiny_model("llama", vocab_size=300)
    other.save_pretrained(tmp_path / "other")
    tiny_tokenizer().save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary"):
        distill.from_pretrained_draft(str(tmp_path / "other"), target)


def test_draft_distilled_for_another_target_warns(tmp_path):
    target = tiny_target("llama")
    other = tiny_target("llama", layers=6)  # same tokenizer and vocabulary, another model
    out = distill.save_draft(distill.from_target_layers(other, [0]), other.tokenizer, other, tmp_path / "d")
    with pytest.warns(UserWarning, match="distilled for target .*num_hidden_layers 6 vs 4"):
        build_drafter(str(out), target)
    mine = distill.save_draft(
        distill.from_target_layers(target, [0]), target.tokenizer, target, tmp_path / "m"
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_drafter(str(mine), target)
