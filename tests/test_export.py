"""``draftsmith export``: EAGLE-3 heads for vLLM/SGLang, distilled drafts, and the export verifier."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny import tiny_target
from transformers import AutoModelForCausalLM

from draftsmith.cli import main
from draftsmith.decode.features import capture_layers
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts import small_lm
from draftsmith.drafts.eagle import EagleConfig, EagleHead, build_vocab_map
from draftsmith.export import export_checkpoint
from draftsmith.export_verify import ExportVerificationError, verify_export

DRAFT_VOCAB = 120


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=8)


def make_eagle_head(target, directory, capture=None):
    """A saved EAGLE-3 head with a real vocab map and distinct (non-unit) norms, so swapped names show."""
    torch.manual_seed(0)
    config = EagleConfig.for_target(target, draft_vocab_size=DRAFT_VOCAB, capture_layer_ids=capture)
    head = EagleHead(config)
    counts = torch.rand(target.vocab_size)
    head.set_vocab_map(*build_vocab_map(counts, DRAFT_VOCAB))
    head.init_from_target(target.model)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.rand_like(param))
    head.save_pretrained(directory)
    return head.eval()


@pytest.fixture(scope="module")
def eagle_dir(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "draft"
    make_eagle_head(target, out)
    return out


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def engine_logits(folder, engine, target, ids):
    """Next-token logits of an exported head at the last position of ``ids``, computed the way the engine's
    loader reads the folder (names, layer-id convention, d2t offsets). A single draft position attends
    only to itself, so attention is o_proj(v) and RoPE at position 0 is the identity."""
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    if engine == "vllm":
        layer_ids, shift = (
            cfg["eagle_aux_hidden_state_layer_ids"],
            0,
        )  # id L = input of layer L = hidden_states[L]
    else:
        layer_ids, shift = (
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
            1,
        )  # SGLang captures at L + 1
    with torch.no_grad():
        states = target.model(ids[None, :-1], output_hidden_states=True).hidden_states
    aux = torch.cat([states[i + shift][0, -1] for i in layer_ids])
    eps = cfg["rms_norm_eps"]
    h = F.linear(aux, w["fc.weight"])
    emb = w["embed_tokens.weight"][ids[-1]]
    x = torch.cat(
        [rms(emb, w["midlayer.input_layernorm.weight"], eps), rms(h, w["midlayer.hidden_norm.weight"], eps)]
    )
    v = F.linear(x, w["midlayer.self_attn.v_proj.weight"]).view(cfg["num_key_value_heads"], cfg["head_dim"])
    v = v.repeat_interleave(cfg["num_attention_heads"] // cfg["num_key_value_heads"], dim=0).flatten()
    h = h + F.linear(v, w["midlayer.self_attn.o_proj.weight"])  # residual = fc output (norm after residual)
    m = rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    mlp = F.linear(
        F.silu(F.linear(m, w["midlayer.mlp.gate_proj.weight"]))
        * F.linear(m, w["midlayer.mlp.up_proj.weight"]),
        w["midlayer.mlp.down_proj.weight"],
    )
    draft = F.linear(rms(h + mlp, w["norm.weight"], eps), w["lm_head.weight"])
    full = torch.full((cfg["vocab_size"],), float("-inf"))
    full[torch.arange(cfg["draft_vocab_size"]) + w["d2t"]] = draft
    return full


def draftsmith_logits(head, target, ids):
    """The same step through draftsmith's own EagleHead (features by its capture hooks)."""
    with torch.no_grad(), capture_layers(target.model, head.config.capture_layer_ids) as store:
        target.model(ids[None, :-1])
        feature = head.fuse({i: store[i][:, -1:] for i in head.config.capture_layer_ids})
        hidden = head.step(feature, ids[None, -1:], torch.zeros(1, 1, dtype=torch.long), None, None)
        draft = head.draft_logits(hidden)[0, 0]
    full = torch.full((head.config.vocab_size,), float("-inf"))
    full[head.d2t] = draft
    return full


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_eagle3_export_computes_what_draftsmith_computes(target, eagle_dir, tmp_path, engine):
    head = EagleHead.from_pretrained(eagle_dir).eval()
    out = export_checkpoint(locate_checkpoint(str(eagle_dir)), engine, tmp_path / engine)
    assert verify_export(out, engine)
    cfg = json.loads((out / "config.json").read_text())
    expected_ids = (
        [i + 1 for i in head.config.capture_layer_ids] if engine == "vllm" else head.config.capture_layer_ids
    )
    assert (
        cfg.get(
            "eagle_aux_hidden_state_layer_ids",
            cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids"),
        )
        == expected_ids
    )
    ids = torch.tensor([5, 17, 99, 3, 42, 7])
    ours, theirs = draftsmith_logits(head, target, ids), engine_logits(out, engine, target, ids)
    assert torch.equal(ours.isinf(), theirs.isinf())
    finite = ~ours.isinf()
    torch.testing.assert_close(theirs[finite], ours[finite], rtol=1e-4, atol=1e-4)


def test_reading_layer_ids_in_the_other_convention_gives_other_logits(target, eagle_dir, tmp_path):
    """The check above can fail: the vLLM folder read with SGLang's convention is off by one layer."""
    head = EagleHead.from_pretrained(eagle_dir).eval()
    out = export_checkpoint(locate_checkpoint(str(eagle_dir)), "vllm", tmp_path / "vllm")
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"]}
    (out / "config.json").write_text(json.dumps(cfg))
    ids = torch.tensor([5, 17, 99, 3, 42, 7])
    ours = draftsmith_logits(head, target, ids)
    wrong = engine_logits(out, "sglang", target, ids)
    assert not torch.allclose(wrong[~ours.isinf()], ours[~ours.isinf()], atol=1e-3)


def break_export(folder, how):
    weights = load_file(str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    if how == "missing":
        del weights["midlayer.hidden_norm.weight"]
    elif how == "renamed":
        weights["midlayer.hidden_norms.weight"] = weights.pop("midlayer.hidden_norm.weight")
    elif how == "absolute_d2t":
        weights["d2t"] = weights["d2t"] + torch.arange(weights["d2t"].numel())
    elif how == "shifted_ids":
        key = "eagle_aux_hidden_state_layer_ids"
        if key in cfg:
            cfg[key] = [i - 1 for i in cfg[key]]
        else:
            cfg["eagle_config"][key] = [i + 1 for i in cfg["eagle_config"][key]]
    elif how == "missing_field":
        del cfg["target_hidden_size"]
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("how", ["missing", "renamed", "absolute_d2t", "shifted_ids", "missing_field"])
def test_verifier_refuses_broken_eagle3_exports(eagle_dir, tmp_path, engine, how):
    out = export_checkpoint(locate_checkpoint(str(eagle_dir)), engine, tmp_path / engine)
    break_export(out, how)
    with pytest.raises(ExportVerificationError):
        verify_export(out, engine)


def test_hf_export_of_an_eagle_head_loads_strictly_and_refuses_a_renamed_weight(eagle_dir, tmp_path):
    out = export_checkpoint(locate_checkpoint(str(eagle_dir)), "hf", tmp_path / "hf")
    assert verify_export(out, "hf")
    weights = load_file(str(out / "model.safetensors"))
    weights["layers.0.hidden_norm.weight"] = weights.pop("layers.0.feature_norm.weight")
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(ExportVerificationError, match="feature_norm|hidden_norm"):
        verify_export(out, "hf")


def test_export_refuses_heads_an_engine_cannot_read(target, tmp_path):
    last = make_eagle_head(target, tmp_path / "last", capture=[1, 3, 7])  # 7 = output of the last layer
    assert last.config.capture_layer_ids == [1, 3, 7]
    with pytest.raises(ValueError, match="last layer"):
        export_checkpoint(locate_checkpoint(str(tmp_path / "last")), "vllm", tmp_path / "out")
    with pytest.raises(ValueError, match="GGUF"):
        export_checkpoint(locate_checkpoint(str(tmp_path / "last")), "gguf", tmp_path / "out2")


@pytest.fixture(scope="module")
def small_draft(target, tmp_path_factory):
    draft = small_lm.from_config(target, 2, 32, seed=0).eval()
    run = tmp_path_factory.mktemp("small")
    (run / "config.yaml").write_text("draft: {kind: distill}\n")
    return draft, small_lm.save_draft(draft, target.tokenizer, target, run / "draft")


@pytest.mark.parametrize("engine", ["hf", "vllm", "sglang"])
def test_small_draft_exports_as_an_ordinary_causal_lm(small_draft, tmp_path, engine):
    draft, path = small_draft
    out = export_checkpoint(locate_checkpoint(str(path.parent)), engine, tmp_path / engine)
    assert verify_export(out, engine)
    assert not (out / "train_state.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, draft(ids).logits)


def test_small_draft_verifier_refuses_a_missing_weight_and_another_vocabulary(small_draft, tmp_path):
    _, path = small_draft
    out = export_checkpoint(locate_checkpoint(str(path)), "vllm", tmp_path / "a")
    weights = load_file(str(out / "model.safetensors"))
    weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportVerificationError, match="up_proj"):
        verify_export(out, "vllm")
    other = export_checkpoint(locate_checkpoint(str(path)), "hf", tmp_path / "b")
    cfg = json.loads((other / "config.json").read_text())
    cfg["draftsmith_target"]["vocab_size"] = 999
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportVerificationError, match="999"):
        verify_export(other, "hf")


def test_cli_exports_verifies_and_refuses_a_non_empty_out(eagle_dir, tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["export", str(eagle_dir), "--to", "sglang", "--out", str(out)]) == 0
    assert "matches what the sglang loader reads" in capsys.readouterr().out
    assert main(["export", str(out), "--to", "sglang", "--verify"]) == 0
    assert main(["export", str(eagle_dir), "--to", "sglang", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    shutil.rmtree(out)
