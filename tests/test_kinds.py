"""One record per draft kind, one name used everywhere, and Medusa with what the other kinds have."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_target

from draftsmith.cli import main
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts import build_drafter, draft_kind, kind_names, kind_of_checkpoint
from draftsmith.drafts.base import kind_of_config
from draftsmith.export import export_checkpoint, verify_export
from draftsmith.train.registry import objective_kinds


def test_every_kind_has_one_name_and_the_trainable_ones_an_objective():
    kinds = ["distill", "eagle1", "eagle3", "layers", "medusa", "mirror", "ngram", "peer_eagle3"]
    assert kind_names() == kinds
    for name in kind_names():
        assert draft_kind(name).name == name
    assert {"distill", "eagle1", "eagle3", "medusa", "mirror"} <= set(objective_kinds())
    assert not {"ngram", "layers", "peer_eagle3"} & set(objective_kinds())  # peer_eagle3: read, not trained
    with pytest.raises(ValueError, match="unknown draft kind 'egale3'.*Did you mean 'eagle3'"):
        draft_kind("egale3")


def test_names_written_by_earlier_versions_still_read():
    assert kind_of_config({"draftsmith_kind": "eagle", "preset": "eagle1"}).name == "eagle1"
    assert kind_of_config({"draftsmith_kind": "eagle"}).name == "eagle3"
    assert kind_of_config({"architectures": ["LlamaForCausalLM"]}).name == "distill"  # any causal LM


def test_a_checkpoint_kind_named_as_a_spec_asks_for_its_directory():
    target = tiny_target("llama")
    for name in ("eagle3", "medusa", "distill", "mirror"):
        with pytest.raises(ValueError, match="loads from a checkpoint directory"):
            build_drafter(name, target)


@pytest.fixture(scope="module")
def medusa_run(tmp_path_factory):
    from draftsmith.train.registry import build_objective

    target = tiny_target("llama", layers=4)
    objective = build_objective("medusa", target, {"num_heads": 2}, None)
    run = tmp_path_factory.mktemp("medusa")
    objective.save(objective.build_draft().eval(), run / "draft")
    (run / "config.yaml").write_text("draft: {kind: medusa}\n")
    return target, run


def test_medusa_exports_to_hf_and_vllm_and_is_refused_by_engines_without_a_loader(medusa_run, tmp_path, capsys):
    target, run = medusa_run
    ckpt = locate_checkpoint(str(run))
    assert ckpt.kind.name == kind_of_checkpoint(run / "draft").name == "medusa"
    out = export_checkpoint(ckpt, "hf", tmp_path / "hf")
    assert verify_export(out, "hf") and not (out / "train_config.yaml").exists()
    exported, original = build_drafter(str(out), target), build_drafter(str(run), target)
    prompt = torch.tensor([3, 1, 4, 1, 5])
    from draftsmith.decode.speculative import generate

    assert (
        generate(target, prompt, exported, 2, 12).tokens == generate(target, prompt, original, 2, 12).tokens
    )
    assert main(["export", str(run), "--to", "vllm", "--out", str(tmp_path / "vllm")]) == 0
    for engine in ("sglang", "speculators", "gguf"):
        assert main(["export", str(run), "--to", engine, "--out", str(tmp_path / engine)]) == 2
        assert "SGLang 0.5.23's released source has no Medusa loader" in capsys.readouterr().err


def test_medusa_publishes_with_a_card(medusa_run, tmp_path):
    _, run = medusa_run
    out = tmp_path / "pub"
    assert main(["publish", str(run), "--repo-id", "me/medusa", "--base-model", "a/b", "--license", "mit",
                 "--no-eval", "--out", str(out), "--dry-run"]) == 0  # fmt: skip
    card = (out / "README.md").read_text()
    assert "medusa" in card.split("---")[1] and "Medusa draft" in card and "--to vllm" in card
    assert json.loads((out / "config.json").read_text())["draftsmith_kind"] == "medusa"


def test_batched_decoding_names_why_a_head_has_no_batched_form(medusa_run):
    from draftsmith.decode.batched import generate_batch

    target, run = medusa_run
    with pytest.raises(ValueError, match="no batched form.*hidden states"):
        generate_batch(
            target, [torch.tensor([1, 2, 3])], build_drafter(str(run), target), k=2, max_new_tokens=4
        )
