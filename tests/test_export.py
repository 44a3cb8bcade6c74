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
from draftsmith.drafts import distill
from draftsmith.drafts.eagle import EagleConfig, EagleHead
from draftsmith.drafts.eagle_parts import build_vocab_map
from draftsmith.drafts.engines import export_engines
from draftsmith.export import export_checkpoint
from draftsmith.export.verify import ExportVerificationError, verify_export

DRAFT_VOCAB = 120


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=8)


def make_eagle_head(target, directory, capture=None, draft_vocab=DRAFT_VOCAB, **norms):
    """A saved EAGLE-3 head with a real vocab map and distinct (non-unit) norms, so swapped names show;
    ``norms``: EAGLE-3.1 norms it has (norm_before_fc=True, ...)."""
    torch.manual_seed(0)
    draft_vocab = draft_vocab or target.vocab_size
    config = EagleConfig.for_target(
        target, draft_vocab_size=draft_vocab, capture_layer_ids=capture and sorted(capture)
    )
    if capture:  # in the order given, as earlier versions saved heads (training now wants layer order)
        config.capture_layer_ids = list(capture)
    for key, value in norms.items():
        setattr(config, key, value)
    head = EagleHead(config)
    counts = torch.rand(target.vocab_size)
    head.set_vocab_map(*build_vocab_map(counts, draft_vocab))
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
    loader reads the folder (docs/EXPORT.md): the layer-id field and convention, states concatenated in
    ascending layer order (both engines capture each layer once, in their layer loop), the tensor names,
    d2t offsets, and vLLM's refusal of a d2t it has no parameter for. A single draft position attends
    only to itself, so attention is o_proj(v) and RoPE at position 0 is the identity."""
    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    if engine == "speculators":
        shape = cfg["transformer_layer_config"]
        w = {k.replace("layers.0.", "midlayer.", 1): v for k, v in w.items()}
        layer_ids, shift = cfg["eagle_aux_hidden_state_layer_ids"], -1
    else:
        shape = cfg
        if engine == "vllm":  # id L = the input of layer L = the output of layer L - 1
            layer_ids, shift = cfg["eagle_aux_hidden_state_layer_ids"], -1
        else:  # SGLang captures at L + 1: the output of layer L
            layer_ids, shift = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], 0
    vocab, draft_vocab = shape["vocab_size"], cfg["draft_vocab_size"]
    if engine != "sglang" and "d2t" in w and draft_vocab == vocab:
        raise ValueError(
            "There is no module or parameter named 'draft_id_to_target_id' in Eagle3LlamaForCausalLM"
        )
    outputs = sorted({i + shift for i in layer_ids})  # draftsmith convention: output of layer i, pre-norm
    with torch.no_grad(), capture_layers(target.model, outputs) as store:
        target.model(ids[None, :-1])
    aux = torch.cat([store[i][0, -1] for i in outputs])
    eps = shape["rms_norm_eps"]
    if engine == "vllm" and cfg.get("norm_before_fc"):  # llama_eagle3.combine_hidden_states: input_norm first
        aux = rms(aux, w["input_norm.weight"], eps)
    h = F.linear(aux, w["fc.weight"])
    emb = w["embed_tokens.weight"][ids[-1]]
    x = torch.cat(
        [rms(emb, w["midlayer.input_layernorm.weight"], eps), rms(h, w["midlayer.hidden_norm.weight"], eps)]
    )
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    v = F.linear(x, w["midlayer.self_attn.v_proj.weight"]).view(kv_heads, head_dim)
    v = v.repeat_interleave(heads // kv_heads, dim=0).flatten()
    # the residual: fc's output, or (vLLM's norm_before_residual) hidden_norm of it
    residual = rms(h, w["midlayer.hidden_norm.weight"], eps) if cfg.get("norm_before_residual") else h
    h = residual + F.linear(v, w["midlayer.self_attn.o_proj.weight"])
    m = rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    mlp = F.linear(
        F.silu(F.linear(m, w["midlayer.mlp.gate_proj.weight"]))
        * F.linear(m, w["midlayer.mlp.up_proj.weight"]),
        w["midlayer.mlp.down_proj.weight"],
    )
    draft = F.linear(rms(h + mlp, w["norm.weight"], eps), w["lm_head.weight"])
    if "d2t" not in w:
        return draft
    full = torch.full((vocab,), float("-inf"))
    full[torch.arange(draft_vocab) + w["d2t"]] = draft
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


HEADS = {
    "default": dict(capture=None, draft_vocab=DRAFT_VOCAB),
    "unordered": dict(
        capture=[5, 1, 3], draft_vocab=DRAFT_VOCAB
    ),  # fc reads 5, 1, 3; engines capture 1, 3, 5
    "full_vocab": dict(capture=None, draft_vocab=None),  # draft vocabulary = the target's: no d2t for vLLM
}


@pytest.fixture(scope="module")
def eagle_heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {
        name: make_eagle_head(target, root / name / "draft", **h) and root / name / "draft"
        for name, h in HEADS.items()
    }


@pytest.mark.parametrize("head_name", sorted(HEADS))
@pytest.mark.parametrize("engine", ["vllm", "sglang", "speculators"])
def test_eagle3_export_computes_what_draftsmith_computes(target, eagle_heads, tmp_path, engine, head_name):
    folder = eagle_heads[head_name]
    head = EagleHead.from_pretrained(folder).eval()
    out = export_checkpoint(locate_checkpoint(str(folder)), engine, tmp_path / engine)
    assert verify_export(out, engine)
    cfg = json.loads((out / "config.json").read_text())
    shift = 0 if engine == "sglang" else 1
    written = cfg.get(
        "eagle_aux_hidden_state_layer_ids",
        cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids"),
    )
    assert written == sorted(i + shift for i in head.config.capture_layer_ids)
    ids = torch.tensor([5, 17, 99, 3, 42, 7])
    ours, theirs = draftsmith_logits(head, target, ids), engine_logits(out, engine, target, ids)
    assert torch.equal(ours.isinf(), theirs.isinf())
    finite = ~ours.isinf()
    torch.testing.assert_close(theirs[finite], ours[finite], rtol=1e-4, atol=1e-4)


EAGLE31 = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


def test_an_eagle31_head_exports_to_vllm_with_its_norms_and_is_refused_by_name_elsewhere(target, tmp_path):
    """The EAGLE-3.1 norms reach vLLM's config and weights (input_norm blocks in fc's ascending order) and the
    engine computes the head's logits; without them (the flags dropped) it computes others, and the verifier
    says which flag is wrong. SGLang's and speculators' layouts carry no norm_before_fc / norm_output: refused,
    naming them."""
    folder = tmp_path / "head" / "draft"
    head = make_eagle_head(target, folder, capture=[5, 1, 3], **EAGLE31)
    out = export_checkpoint(locate_checkpoint(str(folder)), "vllm", tmp_path / "vllm")
    assert verify_export(out, "vllm")
    cfg = json.loads((out / "config.json").read_text())
    assert all(cfg[key] is True for key in EAGLE31)
    ids = torch.tensor([5, 17, 99, 3, 42, 7])
    ours, theirs = draftsmith_logits(head, target, ids), engine_logits(out, "vllm", target, ids)
    finite = ~ours.isinf()
    torch.testing.assert_close(theirs[finite], ours[finite], rtol=1e-4, atol=1e-4)
    for key in ("norm_before_fc", "norm_before_residual"):
        wrong = dict(cfg, **{key: False})
        (out / "config.json").write_text(json.dumps(wrong))
        assert not torch.allclose(engine_logits(out, "vllm", target, ids)[finite], ours[finite], atol=1e-3)
        with pytest.raises(ExportVerificationError, match=f"{key} must be written as true"):
            verify_export(out, "vllm")
    for engine in ("sglang", "speculators"):
        with pytest.raises(
            ValueError, match=f"(?i)norm_before_fc, norm_output: variants of EAGLE-3 the {engine}"
        ):
            export_checkpoint(locate_checkpoint(str(folder)), engine, tmp_path / engine)


def test_an_unordered_head_read_without_the_fc_permutation_gives_other_logits(
    target, eagle_heads, tmp_path, monkeypatch
):
    """The check above can fail: fc's columns left in the head's order are read against ascending states."""
    from draftsmith.export import eagle as eagle_export

    monkeypatch.setattr(eagle_export, "ascending_capture", lambda ids, fc: (sorted(ids), fc))
    folder = eagle_heads["unordered"]
    out = export_checkpoint(locate_checkpoint(str(folder)), "vllm", tmp_path / "vllm")
    ids = torch.tensor([5, 17, 99, 3, 42, 7])
    ours = draftsmith_logits(EagleHead.from_pretrained(folder).eval(), target, ids)
    theirs = engine_logits(out, "vllm", target, ids)
    assert not torch.allclose(theirs[~ours.isinf()], ours[~ours.isinf()], atol=1e-3)


def test_a_full_vocabulary_head_with_d2t_is_what_vllm_refuses(eagle_heads, tmp_path, target):
    """The engine model can fail: d2t written for a full draft vocabulary is vLLM's load-time ValueError."""
    out = export_checkpoint(locate_checkpoint(str(eagle_heads["full_vocab"])), "sglang", tmp_path / "s")
    assert "d2t" in load_file(str(out / "model.safetensors"))  # SGLang reads an identity hot_token_id
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [
        i + 1 for i in cfg.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]
    ]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="draft_id_to_target_id"):
        engine_logits(out, "vllm", target, torch.tensor([5, 17, 99]))
    with pytest.raises(ExportVerificationError, match="d2t"):
        verify_export(out, "vllm")


def test_speculators_export_writes_what_vllm_reads(eagle_heads, tmp_path):
    out = export_checkpoint(locate_checkpoint(str(eagle_heads["default"])), "speculators", tmp_path / "s")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["norm_before_residual"] is False  # vLLM assumes true when it is missing
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert all(not name.startswith("midlayer.") for name in load_file(str(out / "model.safetensors")))
    del cfg["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportVerificationError, match="norm_before_residual"):
        verify_export(out, "speculators")


def test_an_eagle3_export_is_checked_as_eagle3_whatever_fields_it_carries(eagle_heads, tmp_path):
    """The check is the one of the family the folder says it is (speculators' model type), never chosen by
    sniffing a field: a stray mask_token_id (parallel drafting's field) leaves an EAGLE-3 folder an EAGLE-3
    head, as vLLM runs it, not one to be checked as P-EAGLE's."""
    out = export_checkpoint(locate_checkpoint(str(eagle_heads["default"])), "speculators", tmp_path / "s")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"mask_token_id": 3}))
    assert verify_export(out, "speculators")


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
    elif how == "unsorted_ids":
        key = "eagle_aux_hidden_state_layer_ids"
        holder = cfg if key in cfg else cfg["eagle_config"]
        holder[key] = holder[key][::-1]
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize(
    "how", ["missing", "renamed", "absolute_d2t", "shifted_ids", "missing_field", "unsorted_ids"]
)
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


def test_the_last_layer_exports_to_vllm_and_is_refused_where_it_cannot_be_captured(target, tmp_path):
    last = make_eagle_head(target, tmp_path / "last", capture=[1, 3, 7])  # 7 = output of the last layer
    assert last.config.capture_layer_ids == [1, 3, 7]
    ckpt = locate_checkpoint(str(tmp_path / "last"))
    out = export_checkpoint(ckpt, "vllm", tmp_path / "vllm")  # vLLM captures id N = the last layer's output
    ids = torch.tensor([5, 17, 99, 3, 42, 7])
    ours, theirs = draftsmith_logits(last, target, ids), engine_logits(out, "vllm", target, ids)
    torch.testing.assert_close(theirs[~ours.isinf()], ours[~ours.isinf()], rtol=1e-4, atol=1e-4)
    for engine, name in (("sglang", "SGLang"), ("gguf", "llama.cpp")):
        with pytest.raises(ValueError, match=f"last layer.*{name} captures only the inputs"):
            export_checkpoint(ckpt, engine, tmp_path / engine)


def test_a_head_reading_one_layer_twice_is_refused(target, tmp_path):
    with pytest.raises(ValueError, match="layer \\[1\\] read twice"):
        EagleConfig.for_target(target, capture_layer_ids=[1, 1, 3])
    make_eagle_head(target, tmp_path / "dup", capture=[1, 3, 5])
    cfg = json.loads((tmp_path / "dup" / "config.json").read_text())
    cfg["capture_layer_ids"] = [1, 3, 3]  # a head saved by an older version
    (tmp_path / "dup" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="twice"):
        export_checkpoint(locate_checkpoint(str(tmp_path / "dup")), "vllm", tmp_path / "out")


@pytest.fixture(scope="module")
def small_draft(target, tmp_path_factory):
    draft = distill.from_config(target, 2, 32, seed=0).eval()
    run = tmp_path_factory.mktemp("small")
    (run / "config.yaml").write_text("draft: {kind: distill}\n")
    return draft, distill.save_draft(draft, target.tokenizer, target, run / "draft")


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


@pytest.mark.parametrize("engine", ["hf", "vllm", "sglang", "speculators"])
def test_exports_are_readable_by_an_engine_running_as_another_user(eagle_dir, tmp_path, engine):
    import os
    import stat

    source = tmp_path / "private" / "draft"
    shutil.copytree(eagle_dir, source)
    for file in source.iterdir():
        os.chmod(file, 0o600)  # as safetensors and mkstemp leave them
    old = os.umask(0o077)
    try:
        out = export_checkpoint(locate_checkpoint(str(source)), engine, tmp_path / engine)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {0o644}


def test_an_earlier_export_is_replaced_only_with_overwrite_and_nothing_else_ever(eagle_dir, tmp_path, capsys):
    out = tmp_path / "x"
    argv = ["export", str(eagle_dir), "--to", "vllm", "--out"]
    assert main([*argv, str(out)]) == 0
    (out / "notes.txt").write_text("left by the first export")
    assert main([*argv, str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main([*argv, str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        ".draftsmith-files",
        "config.json",
        "model.safetensors",
        "notes.txt",
    ]  # the export replaced, the user's file kept
    assert (out / "notes.txt").read_text() == "left by the first export"
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    file = tmp_path / "file"
    file.write_text("mine")
    for where, said in ((mine, "is not an export draftsmith wrote: it holds sub/"), (file, "is a file"),
                        (eagle_dir, "the checkpoint"), (eagle_dir.parent, "the checkpoint")):  # fmt: skip
        assert main([*argv, str(where), "--overwrite"]) == 2
        assert said in capsys.readouterr().err
    assert main([*argv, str(file)]) == 2
    assert file.read_text() == "mine" and (mine / "sub").is_dir() and (eagle_dir / "config.json").is_file()


def user_model_folder(folder, target) -> dict[str, bytes]:
    """A Hugging Face model folder of the user's own (weights, config, tokenizer; no draftsmith list), as
    ``save_pretrained`` writes it; returns its files' bytes."""
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("engine", [e.name for e in export_engines()])
def test_overwrite_never_replaces_a_users_own_model_folder(eagle_dir, target, tmp_path, capsys, engine):
    """--overwrite replaces only what draftsmith wrote (a folder carrying its .draftsmith-files list): a model
    folder of the user's, with a config.json and weights like an export's, is refused naming what it holds."""
    mine = tmp_path / "mymodel"
    before = user_model_folder(mine, target)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(before)
    capsys.readouterr()  # save_pretrained's bar
    assert main(["export", str(eagle_dir), "--to", engine, "--out", str(mine), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and f"--out {mine} is not an export draftsmith wrote: it holds " in err
    assert all(name in err for name in ("config.json", "model.safetensors", "tokenizer.json")), err
    assert f"({len(before)} entries) and no .draftsmith-files" in err
    after = {p.name: p.read_bytes() for p in sorted(mine.iterdir())}
    assert after == before  # nothing replaced, nothing added
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mymodel"]  # nor anything left beside it


def test_an_export_removes_what_a_killed_export_to_the_same_name_left(eagle_dir, tmp_path):
    """A real kill -9 mid-export leaves a hidden .x.tmp-* folder; the next export to x removes it."""
    import subprocess
    import sys

    out = tmp_path / "x"
    script = f"""
import time
from pathlib import Path
import draftsmith.export as export
from draftsmith.draft_checkpoint import locate_checkpoint
def hang(ckpt, folder):
    (folder / "model.safetensors").write_bytes(bytes(4096))
    print("writing", flush=True)
    time.sleep(120)
export.copy_draft = hang
export.export_checkpoint(locate_checkpoint({str(eagle_dir)!r}), "hf", Path({str(out)!r}))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait()
    (tmp_path / ".y.tmp-1").mkdir()  # another name's: not this export's to remove
    assert [p.name[:7] for p in tmp_path.iterdir() if p.name.startswith(".x")] == [".x.tmp-"]
    export_checkpoint(locate_checkpoint(str(eagle_dir)), "hf", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".y.tmp-1", "x"]


@pytest.mark.parametrize("engine", ["hf", "vllm", "sglang", "speculators"])
def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(
    eagle_dir, tmp_path, capsys, monkeypatch, engine
):
    """A write that runs out of space midway, as the OS says it (OSError ENOSPC from a copy) or as safetensors
    does (a SafetensorError whose text alone says so, no errno): one line naming --out, exit 2, nothing left."""
    import errno

    import safetensors

    import draftsmith.export as export_pkg
    import draftsmith.export.eagle as eagle_export

    def half_then_full(data, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)  # what reached the disk before it filled
        if engine == "hf":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise safetensors.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    if engine == "hf":
        monkeypatch.setattr(export_pkg.shutil, "copyfile", lambda src, dst: half_then_full(None, dst))
    else:
        monkeypatch.setattr(eagle_export, "save_file", half_then_full)
    out = tmp_path / "out"
    assert main(["export", str(eagle_dir), "--to", engine, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err], err
    assert f"could not write the export to {out} (no space left on device); nothing temporary" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing temporary beside --out, and no --out
