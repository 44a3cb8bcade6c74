"""EAGLE-3 heads other pipelines wrote, read by draftsmith (drafts/eagle_import.py).

Judged by the peers' own code where their packages run (``bash scripts/install_peers.sh``: one venv each
under the draftsmith cache): a small head built and saved by the peer's own model classes, and its logits
from the peer's own forward on fixed inputs (tests/peer_worker.py), against draftsmith's import of the saved
folder. Without the venvs those tests skip; the rest writes each layout itself (from draftsmith's own
exporters where they exist) and runs always.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_bpe_target_gguf, tiny_target

from draftsmith import llamacpp
from draftsmith.cli import main
from draftsmith.decode.speculative import generate
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts import eagle_import
from draftsmith.drafts.base import PEER_EAGLE3, build_drafter, kind_of_checkpoint
from draftsmith.drafts.eagle import EagleConfig, EagleHead
from draftsmith.drafts.eagle_import import HeadImportError, import_head
from draftsmith.drafts.eagle_parts import build_vocab_map
from draftsmith.export import export_checkpoint
from draftsmith.export.eagle import layer_names, reference_weights
from draftsmith.export.speculators import speculators_config
from draftsmith.export.verify import verify_export

DRAFT_VOCAB = 120  # < the tiny BPE vocabulary of 300: every layout's d2t is exercised
PEERS_ROOT = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")) / "peers"
WORKER = Path(__file__).with_name("peer_worker.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The 8-layer tiny BPE target (a directory and its F32 GGUF, for the llama.cpp export)."""
    root = tmp_path_factory.mktemp("peers")
    target, target_gguf = tiny_bpe_target_gguf(root)
    return {"root": root, "target": target, "dir": root / "target", "gguf": target_gguf}


def draftsmith_head(target, capture=None, **variant) -> EagleHead:
    """A random draftsmith EAGLE-3 head whose norms are not all ones (so a norm mapped wrong shows)."""
    torch.manual_seed(0)
    cfg = EagleConfig.for_target(
        target, draft_vocab_size=DRAFT_VOCAB, capture_layer_ids=capture and sorted(capture)
    )
    if capture:  # in the order given, as earlier versions saved heads (training now wants layer order)
        cfg.capture_layer_ids = list(capture)
    for key, value in variant.items():
        setattr(cfg, key, value)
    head = EagleHead(cfg)
    head.init_from_target(target.model)
    head.set_vocab_map(*build_vocab_map(torch.rand(target.vocab_size), DRAFT_VOCAB))
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name == "lm_head.weight":
                param.add_(0.05 * torch.randn_like(param))
    return head.eval()


def inputs(target, layers, T: int = 10, seed: int = 1) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (2, T), generator=gen)
    return ids, {i: torch.randn(2, T, target.config.hidden_size, generator=gen) for i in layers}


def assert_same_head(ours: EagleHead, theirs: EagleHead, target, steps: int = 3) -> None:
    """Same target layers and vocabulary map, and the same logits at every TTT step."""
    assert ours.config.capture_layer_ids == sorted(theirs.config.capture_layer_ids)
    assert torch.equal(ours.d2t, theirs.d2t) and torch.equal(ours.t2d, theirs.t2d)
    ids, feats = inputs(target, ours.config.capture_layer_ids)
    with torch.no_grad():
        for a, b in zip(ours(ids, feats, steps=steps).logits, theirs(ids, feats, steps=steps).logits):
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def write_layout(folder: Path, config: dict, tensors: dict[str, torch.Tensor], as_bin: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if as_bin:
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def read_layout(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def exported(head: EagleHead, tmp_path: Path, engine: str) -> Path:
    head.save_pretrained(tmp_path / "draft")
    return export_checkpoint(
        locate_checkpoint(str(tmp_path / "draft")), engine, tmp_path / f"export-{engine}"
    )


def reference_layout(head: EagleHead, folder: Path) -> Path:
    """The SafeAILab/EAGLE reference layout (what SpecForge's sglang export also is): no layer ids, no token
    embedding, d2t offsets; here in a pytorch_model.bin with no t2d, as the oldest checkpoints come."""
    config = {k: v for k, v in _sglang_config(head).items() if k not in ("eagle_config", "draftsmith_source")}
    config["architectures"] = ["LlamaForCausalLM"]  # what the yuhuili/EAGLE3-* configs say
    tensors = reference_weights(dict(head.state_dict()), head.config.to_dict(), "sglang")
    tensors = {k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "t2d")}
    return write_layout(folder, config, tensors, as_bin=True)


def _sglang_config(head: EagleHead) -> dict:
    from draftsmith.export.eagle import reference_config

    return reference_config(head.config.to_dict(), "sglang", torch.float32)


def modelopt_layout(head: EagleHead, folder: Path, layer_ids: list[int] | None) -> Path:
    """ModelOpt's export_hf_checkpoint layout, as its hf_spec_export.py writes it (layers.N.*, d2t only, its
    eagle_config flags, the YaRN scaling it adds for serving, torch_dtype from its default config)."""
    config = {k: v for k, v in _sglang_config(head).items() if k != "draftsmith_source"}
    config["eagle_config"] = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                              "use_last_layernorm": True, "use_mtp_layernorm": False, "next_layer_regular": True,
                              "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1}  # fmt: skip
    if layer_ids is not None:
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = layer_ids
    config |= {"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048},
               "rms_norm_eps": head.config.rms_norm_eps, "torch_dtype": "bfloat16"}  # fmt: skip
    tensors = reference_weights(dict(head.state_dict()), head.config.to_dict(), "sglang")
    tensors = {
        k.replace("midlayer.", "layers.0."): v
        for k, v in tensors.items()
        if k not in ("embed_tokens.weight", "t2d")
    }
    return write_layout(folder, config, tensors)


def speculators_layout(head: EagleHead, folder: Path) -> Path:
    """The speculators format with its options on (speculators train's defaults for eagle3)."""
    state = dict(head.state_dict())
    fuse_norm = state.pop("fuse_norm.weight", None)
    cfg = head.config.to_dict()
    config = speculators_config(cfg, torch.float32, {})
    config["architectures"] = ["Eagle3DraftModel"]  # what speculators' own save_pretrained writes
    for key in ("norm_before_residual", "norm_before_fc", "norm_output"):
        config[key] = bool(cfg.get(key))
    config.pop("draftsmith_source")
    tensors = layer_names(reference_weights(state, {**cfg, "norm_before_fc": False}, "speculators"))
    if fuse_norm is not None:
        tensors["input_norm.weight"] = fuse_norm
    return write_layout(folder, config, tensors)


# -- layouts written here: always run ---------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang", "speculators"])
def test_draftsmiths_own_exports_read_back_as_the_same_head(tiny, tmp_path, engine):
    """The three engine layouts draftsmith writes (ids in each engine's convention, fc permuted ascending,
    d2t as offsets) read back as the head that was exported: the inverse of export/eagle.py."""
    target = tiny["target"]
    head = draftsmith_head(target, capture=[5, 1, 3])
    folder = exported(head, tmp_path, engine)
    assert kind_of_checkpoint(folder).name == PEER_EAGLE3
    assert_same_head(import_head(target, folder), head, target)


def test_the_reference_layout_reads_with_its_own_default_layers_and_the_targets_embedding(tiny, tmp_path):
    target = tiny["target"]
    head = draftsmith_head(target)  # default layers of an 8-layer target: outputs 1, 3, 4
    imported = import_head(target, reference_layout(head, tmp_path / "ref"))
    assert_same_head(imported, head, target)
    notes = " ".join(imported.config.imported_from["notes"])
    assert "reference layout's own layers" in notes and "the target's" in notes
    assert torch.equal(imported.embed_tokens.weight, target.model.get_input_embeddings().weight)


def test_a_bfloat16_head_reads_as_its_weights_are(tiny, tmp_path):
    """SpecForge exports bf16: the weights are read as stored, for a target in float32."""
    target = tiny["target"]
    head = draftsmith_head(target)
    folder = reference_layout(head, tmp_path / "ref")
    tensors = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save(
        {k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()},
        folder / "pytorch_model.bin",
    )
    imported = import_head(target, folder)
    assert imported.dtype == torch.float32
    expected = head.fuse_features.weight.detach().bfloat16().float()
    assert torch.equal(imported.fuse_features.weight, expected)


def test_a_modelopt_head_normalizes_its_feature_twice_and_keeps_plain_rope(tiny, tmp_path):
    target = tiny["target"]
    head = draftsmith_head(target, capture=[1, 3, 5], feature_input_norm=True)
    folder = modelopt_layout(head, tmp_path / "modelopt", [5, 1, 3])  # ModelOpt captures in layer order
    imported = import_head(target, folder)
    assert imported.config.feature_input_norm and imported.config.rope_theta == head.config.rope_theta
    assert_same_head(imported, head, target)
    notes = " ".join(imported.config.imported_from["notes"])
    assert "YaRN" in notes and "ascending order" in notes


def test_the_speculators_norm_options_are_read(tiny, tmp_path):
    target = tiny["target"]
    options = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
    head = draftsmith_head(target, capture=[1, 3, 5], **options)
    imported = import_head(target, speculators_layout(head, tmp_path / "spec"))
    assert {k: getattr(imported.config, k) for k in options} == options
    assert_same_head(imported, head, target)


def test_each_variant_option_changes_the_head(tiny):
    """The options are not decoration: turning any one off changes the logits."""
    target = tiny["target"]
    on = {
        "norm_before_residual": True,
        "norm_before_fc": True,
        "norm_output": True,
        "feature_input_norm": True,
    }
    full = draftsmith_head(target, **on)
    ids, feats = inputs(target, full.config.capture_layer_ids)
    for key in on:
        part = draftsmith_head(target, **{**on, key: False})
        part.load_state_dict(full.state_dict(), strict=False)
        with torch.no_grad():
            delta = (part(ids, feats, steps=2).logits[1] - full(ids, feats, steps=2).logits[1]).abs().max()
        assert delta > 1e-3, key


def test_greedy_decoding_with_an_imported_head_is_the_targets_own(tiny, tmp_path):
    target = tiny["target"]
    folder = reference_layout(draftsmith_head(target), tmp_path / "ref")
    drafter = build_drafter(str(folder), target)  # what `draftsmith eval --draft DIR` calls
    prompt = torch.tensor(target.tokenizer("def add(a, b): return a + b", add_special_tokens=False).input_ids)
    plain = generate(target, prompt, None, max_new_tokens=24).tokens
    assert generate(target, prompt, drafter, k=4, max_new_tokens=24).tokens == plain


def test_eval_command_reads_an_imported_head(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "The quick brown fox", "category": "chat"}) + "\n")
    folder = modelopt_layout(
        draftsmith_head(tiny["target"], feature_input_norm=True), tmp_path / "mo", [1, 3, 4]
    )
    argv = ["eval", "--target", str(tiny["dir"]), "--draft", str(folder), "--prompts", str(prompts),
            "--max-new-tokens", "12", "--k", "3", "--cpu-kernels", "stock", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [d["exact_match"] for d in report["drafts"]] == [True]


# -- refusals ---------------------------------------------------------------------------------------


def test_a_head_for_another_target_is_refused(tiny, tmp_path):
    folder = reference_layout(draftsmith_head(tiny["target"]), tmp_path / "ref")
    with pytest.raises(HeadImportError, match="hidden states of size 32.*has 48: a head for another target"):
        import_head(tiny_target("llama", layers=8, hidden=48), folder)
    with pytest.raises(HeadImportError, match="vocabulary of 300 tokens.*has 259: a head for another target"):
        import_head(tiny_target("llama", layers=8), folder)
    config, tensors = read_layout(
        exported(draftsmith_head(tiny["target"], capture=[1, 3, 7]), tmp_path, "vllm")
    )
    with pytest.raises(HeadImportError, match=r"\[2, 4, 8\] lies outside this 6-layer target"):
        import_head(
            tiny_target("llama", layers=6, vocab_size=300), write_layout(tmp_path / "v", config, tensors)
        )


def test_an_unknown_layout_names_the_fields_it_has(tiny, tmp_path):
    config = {
        "architectures": ["MedusaEagleHeads"],
        "draft_vocab_size": 120,
        "hidden_size": 32,
        "medusa_num_heads": 4,
    }
    folder = write_layout(tmp_path / "odd", config, {"heads.0.weight": torch.zeros(2, 2)})
    assert kind_of_checkpoint(folder).name == PEER_EAGLE3  # never read as an independent causal LM
    with pytest.raises(HeadImportError) as err:
        build_drafter(str(folder), tiny["target"])
    for needle in (
        "not an EAGLE-3 layout draftsmith knows",
        "'MedusaEagleHeads'",
        "medusa_num_heads",
        "heads",
    ):
        assert needle in str(err.value)


@pytest.mark.parametrize("layout", ["speculators", "modelopt"])
def test_missing_layer_ids_say_what_each_engine_would_guess_and_refuse(tiny, tmp_path, layout):
    head = draftsmith_head(tiny["target"], capture=[1, 3, 5])
    if layout == "speculators":
        config, tensors = read_layout(exported(head, tmp_path, "speculators"))
        del config["eagle_aux_hidden_state_layer_ids"]
        folder = write_layout(tmp_path / "no-ids", config, tensors)
    else:
        folder = modelopt_layout(
            draftsmith_head(tiny["target"], feature_input_norm=True), tmp_path / "mo", None
        )
    with pytest.raises(HeadImportError) as err:
        import_head(tiny["target"], folder)
    message = str(err.value)
    for needle in ("names no target layers", "has no default", "vLLM would capture (2, N/2, N-3) = [2, 4, 5]",
                   "SGLang the same layers", "llama.cpp", "outputs of layers [1, 3, 4]"):  # fmt: skip
        assert needle in message


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda c: c.update(fc_norm=True), "fc_norm is true"),
        (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "transformer_layer_config.model_type"),
        (lambda c: c["transformer_layer_config"].update(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
         "transformer_layer_config.rope_scaling"),
        (lambda c: c["transformer_layer_config"].pop("rms_norm_eps"), "transformer_layer_config.rms_norm_eps"),
        (lambda c: c["transformer_layer_config"].update(mlp_bias=True), "mlp_bias is true"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 2, 4]), "names a layer twice"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 6, 7]), r"fc.weight has shape \(32, 96\)"),
    ],
)  # fmt: skip
def test_what_cannot_be_mapped_is_refused_naming_the_field(tiny, tmp_path, edit, field):
    config, tensors = read_layout(
        exported(draftsmith_head(tiny["target"], capture=[1, 3, 5]), tmp_path, "speculators")
    )
    edit(config)
    with pytest.raises(HeadImportError, match=field):
        import_head(tiny["target"], write_layout(tmp_path / "edited", config, tensors))


def test_two_spellings_of_the_layer_ids_must_agree(tiny, tmp_path):
    config, tensors = read_layout(
        exported(draftsmith_head(tiny["target"], capture=[1, 3, 5]), tmp_path, "sglang")
    )
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 6]  # vLLM's spelling of the same layers: fine
    assert import_head(
        tiny["target"], write_layout(tmp_path / "both", config, tensors)
    ).config.capture_layer_ids == [1, 3, 5]
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]  # read as vLLM's: other layers
    with pytest.raises(HeadImportError, match="name different layers"):
        import_head(tiny["target"], write_layout(tmp_path / "disagree", config, tensors))


def test_weights_that_do_not_fit_are_refused_by_name(tiny, tmp_path):
    config, tensors = read_layout(exported(draftsmith_head(tiny["target"]), tmp_path, "sglang"))
    tensors["midlayer.self_attn.q_norm.weight"] = torch.ones(8)
    with pytest.raises(HeadImportError, match=r"not mapped \['midlayer.self_attn.q_norm.weight'\]"):
        import_head(tiny["target"], write_layout(tmp_path / "extra", config, tensors))
    tensors.pop("midlayer.self_attn.q_norm.weight")
    tensors["d2t"] = tensors["d2t"] + torch.arange(DRAFT_VOCAB)  # absolute ids where offsets belong
    with pytest.raises(HeadImportError, match="should hold offsets"):
        import_head(tiny["target"], write_layout(tmp_path / "absolute", config, tensors))


# -- export of an imported head --------------------------------------------------------------------


def test_export_of_an_imported_head_needs_its_target(tiny, tmp_path, capsys):
    folder = reference_layout(draftsmith_head(tiny["target"]), tmp_path / "ref")
    assert main(["export", str(folder), "--to", "gguf", "--out", str(tmp_path / "h.gguf")]) == 2
    assert "pass --target" in capsys.readouterr().err
    out = tmp_path / "hf"
    assert main(["export", str(folder), "--to", "hf", "--target", str(tiny["dir"]), "--out", str(out)]) == 0
    assert kind_of_checkpoint(out).name == "eagle3"  # now in draftsmith's own layout
    assert_same_head(EagleHead.from_pretrained(out), import_head(tiny["target"], folder), tiny["target"])


def test_a_head_from_another_pipeline_is_converted_before_it_is_published(tiny, tmp_path, capsys):
    folder = reference_layout(draftsmith_head(tiny["target"]), tmp_path / "ref")
    argv = ["publish", str(folder), "--repo-id", "me/head", "--base-model", "a/b", "--license", "mit", "--no-eval",
            "--out", str(tmp_path / "pub"), "--dry-run"]  # fmt: skip
    assert main(argv) == 2
    assert "--to hf --target" in capsys.readouterr().err


def test_an_imported_variant_is_not_exported_as_a_plain_head(tiny, tmp_path, capsys):
    folder = modelopt_layout(
        draftsmith_head(tiny["target"], feature_input_norm=True), tmp_path / "mo", [1, 3, 4]
    )
    argv = ["export", str(folder), "--to", "gguf", "--target", str(tiny["dir"]), "--target-gguf", str(tiny["gguf"]),
            "--out", str(tmp_path / "mo.gguf")]  # fmt: skip
    assert main(argv) == 2
    assert "feature_input_norm" in capsys.readouterr().err and not (tmp_path / "mo.gguf").exists()


def test_vllm_serves_a_peers_variant_from_the_folder_the_peer_wrote(tiny, tmp_path):
    """bench/vllm_engine.py: a head whose variant draftsmith's vLLM layout cannot carry (ModelOpt's input norm on the
    fused feature) is served from the peer's own folder; one it carries (the EAGLE-3.1 norms speculators trains)
    from draftsmith's export, and draftsmith's own head is never silently swapped."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import vllm_engine

    options = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
    spec = speculators_layout(draftsmith_head(tiny["target"], **options), tmp_path / "spec")
    ckpt = locate_checkpoint(str(spec))
    assert ckpt.kind.name == PEER_EAGLE3
    read = vllm_engine.import_peer_head(ckpt, str(tiny["dir"]), tmp_path / "read")
    out = tmp_path / "spec-vllm"
    assert vllm_engine.served_folder(read, ckpt.draft_dir, out) == out
    assert all(json.loads((out / "config.json").read_text())[key] is True for key in options)

    mo = modelopt_layout(draftsmith_head(tiny["target"], feature_input_norm=True), tmp_path / "mo", [1, 3, 4])
    ckpt = locate_checkpoint(str(mo))
    read = vllm_engine.import_peer_head(ckpt, str(tiny["dir"]), tmp_path / "mo-read")
    assert vllm_engine.served_folder(read, ckpt.draft_dir, tmp_path / "mo-vllm") == ckpt.draft_dir
    assert not (tmp_path / "mo-vllm" / "config.json").exists()

    ours = tmp_path / "ours"
    draftsmith_head(tiny["target"], feature_input_norm=True).save_pretrained(ours)
    with pytest.raises(ValueError, match="feature_input_norm"):  # no peer folder to fall back on: refused
        vllm_engine.served_folder(locate_checkpoint(str(ours)), None, tmp_path / "ours-vllm")


def imported_head_gguf(tiny, tmp_path):
    """(the head, the GGUF of it read back from the reference layout by ``draftsmith export --to gguf``)."""
    head = draftsmith_head(tiny["target"])
    folder = reference_layout(head, tmp_path / "ref")
    gguf_file = tmp_path / "imported.gguf"
    argv = ["export", str(folder), "--to", "gguf", "--target", str(tiny["dir"]), "--target-gguf", str(tiny["gguf"]),
            "--gguf-dtype", "f32", "--out", str(gguf_file)]  # fmt: skip
    assert main(argv) == 0
    assert verify_export(gguf_file, "gguf")
    return head, gguf_file


def test_gguf_of_an_imported_head_is_the_gguf_of_the_head(tiny, tmp_path):
    """Read a reference-layout head, export it to llama.cpp: the same file as exporting the head it came from."""
    import gguf

    head, gguf_file = imported_head_gguf(tiny, tmp_path)
    head.save_pretrained(tmp_path / "own")
    own = export_checkpoint(locate_checkpoint(str(tmp_path / "own")), "gguf", tmp_path / "own.gguf", "f32",
                            str(tiny["gguf"]))  # fmt: skip
    theirs, ours = gguf.GGUFReader(str(gguf_file)), gguf.GGUFReader(str(own))
    assert list(theirs.fields["eagle3.target_layers"].contents()) == [2, 4, 5]
    tensors = {t.name: t.data.copy() for t in ours.tensors}
    assert {t.name for t in theirs.tensors} == set(tensors)
    for t in theirs.tensors:
        assert (t.data == tensors[t.name]).all(), t.name


@pytest.mark.engine
@pytest.mark.skipif(
    not llamacpp.available(), reason=f"llama.cpp is not built (optional extra: {llamacpp.INSTALL})"
)
def test_llamacpp_decodes_with_an_imported_heads_gguf_as_the_target_would(tiny, tmp_path):
    _, gguf_file = imported_head_gguf(tiny, tmp_path)
    run_in_llamacpp(tiny["target"], tiny["gguf"], gguf_file)


def run_in_llamacpp(target, target_gguf: Path, head_gguf: Path) -> None:
    """llama.cpp's own speculative decoding with the head: its output is the target's greedy output."""
    prompt = target.tokenizer("x = 12345;  y=-3.5e7", add_special_tokens=False).input_ids
    args = ["--spec-type", "draft-eagle3", "--spec-draft-model", str(head_gguf), "--spec-draft-n-max", "4",
            "--spec-draft-p-min", "0", "-c", "256"]  # fmt: skip
    with llamacpp.Server(target_gguf, args) as server:
        out = server.complete(prompt, 24)
    assert out["tokens"] == generate(target, torch.tensor(prompt), None, max_new_tokens=24).tokens
    assert out["timings"]["draft_n"] > 0


# -- the peers' own code: needs scripts/install_peers.sh --------------------------------------------

PEER_SETTINGS = {
    # speculators: vLLM's convention (id L = the input of layer L), its trainer's norm options on
    "speculators": {"peer_layer_ids": [2, 4, 6], "draft_layers": [1, 3, 5]},
    # SpecForge: no ids written (SGLang's default, which SpecForge trains on)
    "specforge": {"peer_layer_ids": None, "draft_layers": [1, 3, 4]},
    # ModelOpt: its own 0-based outputs, listed out of order (it captures in layer order)
    "modelopt": {"peer_layer_ids": [5, 1, 3], "draft_layers": [1, 3, 5]},
}


def peer_python(peer: str) -> Path:
    python = PEERS_ROOT / peer / "bin" / "python"
    if not (python.is_file() and (PEERS_ROOT / peer / ".draftsmith-installed").is_file()):
        pytest.skip(f"the {peer} venv is absent (optional: bash scripts/install_peers.sh {peer})")
    return python


@pytest.fixture(scope="module", params=list(PEER_SETTINGS))
def peer_head(request, tiny):
    """The peer's own head for the tiny target, saved in its own export layout, and its own forward's logits."""
    peer = request.param
    python = peer_python(peer)
    out = tiny["root"] / peer
    settings = {"draft_vocab_size": DRAFT_VOCAB, "seq_len": 12, "ttt_steps": 3, "seed": 0,
                "peer_layer_ids": PEER_SETTINGS[peer]["peer_layer_ids"]}  # fmt: skip
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([str(python), str(WORKER), peer, str(tiny["dir"]), str(out), json.dumps(settings)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{peer} worker failed:\n{done.stderr[-3000:]}"
    return peer, out / "head", load_file(str(out / "io.safetensors"))


@pytest.mark.engine
def test_draftsmith_reads_the_peers_head_as_the_peers_own_forward_runs_it(peer_head, tiny):
    peer, folder, io = peer_head
    head = import_head(tiny["target"], folder)
    assert head.config.imported_from["layout"] == {"speculators": "speculators", "specforge": "reference",
                                                   "modelopt": "modelopt"}[peer]  # fmt: skip
    assert head.config.capture_layer_ids == PEER_SETTINGS[peer]["draft_layers"]
    features = {int(k.split(".")[1]): v for k, v in io.items() if k.startswith("feature.")}
    assert sorted(features) == head.config.capture_layer_ids  # the layers the peer itself captured
    steps = sum(k.startswith("logits.") for k in io)
    with torch.no_grad():
        ours = head(io["input_ids"], features, steps=steps).logits
    for j in range(steps):
        theirs = io[f"logits.{j}"]
        assert torch.allclose(ours[j][:, : theirs.shape[1]], theirs, atol=1e-5), (peer, j)


@pytest.mark.engine
def test_without_the_peers_variant_the_logits_differ(peer_head, tiny, monkeypatch):
    """The check above can fail: read as a plain EAGLE-3 head, a variant head computes something else."""
    peer, folder, io = peer_head
    if peer == "specforge":
        pytest.skip("SpecForge's head is the plain reference EAGLE-3 head")
    monkeypatch.setattr(eagle_import, "variant_options", lambda config, layout: {})
    monkeypatch.setattr(
        eagle_import, "head_state", lambda t, layout, n, options: _without_fc_norm(t, layout, n)
    )
    head = import_head(tiny["target"], folder)
    features = {int(k.split(".")[1]): v for k, v in io.items() if k.startswith("feature.")}
    with torch.no_grad():
        ours = head(io["input_ids"], features, steps=1).logits[0]
    assert not torch.allclose(ours[:, : io["logits.0"].shape[1]], io["logits.0"], atol=1e-3)


_head_state = eagle_import.head_state


def _without_fc_norm(tensors, layout, n_layers):
    return _head_state({k: v for k, v in tensors.items() if k != "input_norm.weight"}, layout, n_layers, {})


@pytest.mark.engine
def test_greedy_decoding_with_the_peers_head_is_the_targets_own(peer_head, tiny):
    peer, folder, _ = peer_head
    target = tiny["target"]
    drafter = build_drafter(str(folder), target)
    prompt = torch.tensor(target.tokenizer("Speculative decoding drafts", add_special_tokens=False).input_ids)
    plain = generate(target, prompt, None, max_new_tokens=24).tokens
    assert generate(target, prompt, drafter, k=4, max_new_tokens=24).tokens == plain, peer


def specforge_gguf(peer_head, tiny, tmp_path) -> Path:
    peer, folder, _ = peer_head
    if peer != "specforge":
        pytest.skip("only the plain reference layout has a GGUF (the variants have no llama.cpp form here)")
    gguf_file = tmp_path / "specforge.gguf"
    argv = ["export", str(folder), "--to", "gguf", "--target", str(tiny["dir"]), "--target-gguf", str(tiny["gguf"]),
            "--gguf-dtype", "f32", "--out", str(gguf_file)]  # fmt: skip
    assert main(argv) == 0 and verify_export(gguf_file, "gguf")
    return gguf_file


@pytest.mark.engine
def test_specforges_head_exports_to_gguf(peer_head, tiny, tmp_path):
    specforge_gguf(peer_head, tiny, tmp_path)


@pytest.mark.engine
@pytest.mark.skipif(
    not llamacpp.available(), reason=f"llama.cpp is not built (optional extra: {llamacpp.INSTALL})"
)
def test_specforges_head_decodes_in_llamacpp_as_the_target_would(peer_head, tiny, tmp_path):
    run_in_llamacpp(tiny["target"], tiny["gguf"], specforge_gguf(peer_head, tiny, tmp_path))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_heldout_judge_scores_a_peer_head_as_the_head_it_came_from(tiny, tmp_path):
    """``bench/heldout_tau.py`` (the sweep's one judge) builds the objective of a speculators-layout head (its
    norm options on) with the head itself inside, and passes draftsmith's own heads through untouched."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import heldout_tau

    target = tiny["target"]
    options = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
    head = draftsmith_head(target, capture=[1, 3, 5], **options)
    folder = speculators_layout(head, tmp_path / "spec")
    (tmp_path / "scratch").mkdir()
    objective = heldout_tau.objective_for("eagle3", {}, str(folder), target, tmp_path / "scratch")
    assert_same_head(objective.build_draft().eval(), head, target)
    head.save_pretrained(tmp_path / "own")
    assert heldout_tau.own_head(str(tmp_path / "own"), target, tmp_path / "scratch") == str(tmp_path / "own")
