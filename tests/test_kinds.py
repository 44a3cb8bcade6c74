"""One record per draft kind, one name used everywhere, Medusa with what the other kinds have, and a kind
with a family of its own, declared in one temporary module, exported, verified and carded."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_target

from draftsmith.cli import main
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts import build_drafter, draft_kind, kind_names, kind_of_checkpoint
from draftsmith.drafts.base import DISTILL, EAGLE3, NGRAM, PEER_EAGLE3, Family, kind_of_config
from draftsmith.export import export_checkpoint, verify_export
from draftsmith.train.registry import check_objective_options, objective_kinds


def test_every_kind_has_one_name_and_the_trainable_ones_an_objective():
    names = kind_names()
    assert len(names) == len(set(names)) and {EAGLE3, DISTILL, NGRAM} <= set(names)
    for name in names:
        kind = draft_kind(name)
        assert kind.name == name and isinstance(kind.family, Family), name
    for name in set(objective_kinds()) & set(names):  # other tests register objectives of no kind
        check_objective_options(name, {})  # imports its module, which registers the objective
        assert draft_kind(name).family.checkpoint, f"{name} trains, so it saves a checkpoint"
    untrained = {n for n in names if not draft_kind(n).family.checkpoint} | {PEER_EAGLE3}  # read, not trained
    assert untrained & set(objective_kinds()) == set() and NGRAM in untrained
    with pytest.raises(ValueError, match="unknown draft kind 'egale3'.*Did you mean 'eagle3'"):
        draft_kind("egale3")
    # as like 'peagle' by difflib's ratio alone
    with pytest.raises(ValueError, match="Did you mean 'eagle3'"):
        draft_kind("eagle4")


def test_names_written_by_earlier_versions_still_read():
    assert kind_of_config({"draftsmith_kind": "eagle", "preset": "eagle1"}).name == "eagle1"
    assert kind_of_config({"draftsmith_kind": "eagle"}).name == "eagle3"
    assert kind_of_config({"architectures": ["LlamaForCausalLM"]}).name == "distill"  # any causal LM


def test_a_checkpoint_kind_named_as_a_spec_asks_for_its_directory():
    target = tiny_target("llama")
    for name in kind_names():
        if draft_kind(name).family.checkpoint:
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


def test_medusa_exports_to_vllm_and_is_refused_by_engines_without_a_loader(medusa_run, tmp_path, capsys):
    """--to hf and its reload, for every trainable kind: tests/test_kind_contract.py."""
    _, run = medusa_run
    ckpt = locate_checkpoint(str(run))
    assert ckpt.kind.name == kind_of_checkpoint(run / "draft").name == "medusa"
    out = export_checkpoint(ckpt, "hf", tmp_path / "hf")
    assert verify_export(out, "hf") and not (out / "train_config.yaml").exists()  # run records left behind
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


TOY_KIND = '''
"""A toy kind with a family of its own: its record, nothing else (no edit of export/ or publish/)."""
from draftsmith.drafts.base import DraftKind, Family, register


def card_lines(config):
    return [f"- {config['toy_width']} toy units"]


TOY_FAMILY = Family("toy_family", "toy draft", card_lines=card_lines)
TOY = register(DraftKind("toy", "toy draft", lambda target, path: None, TOY_FAMILY))
'''


@pytest.fixture
def toy_run(tmp_path, monkeypatch):
    """The toy kind's module imported from a temporary folder, a run of it on disk, both forgotten after."""
    import importlib
    import sys

    from safetensors.torch import save_file

    from draftsmith.drafts.base import _KINDS

    (tmp_path / "toy_kind.py").write_text(TOY_KIND)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("toy_kind")
        run = tmp_path / "toy-run"
        (run / "draft").mkdir(parents=True)
        config = {"draftsmith_kind": "toy", "target": tiny_target("llama").record(), "toy_width": 3}
        (run / "draft" / "config.json").write_text(json.dumps(config))
        save_file({"w": torch.zeros(3)}, str(run / "draft" / "model.safetensors"))
        (run / "config.yaml").write_text("draft: {kind: toy}\n")
        yield run
    finally:
        _KINDS.pop("toy", None)
        sys.modules.pop("toy_kind", None)


def test_a_kind_with_a_new_family_exports_verifies_and_publishes_from_its_record(toy_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(toy_run), "--to", "hf", "--out", str(out)]) == 0
    assert f"toy draft in {out} matches what the hf loader reads" in capsys.readouterr().out
    (out / "model.safetensors").unlink()  # the family's generic check: config names kind and target, weights
    assert main(["export", str(out), "--to", "hf", "--verify"]) == 2
    assert "no *.safetensors weights" in capsys.readouterr().err

    for engine in ("vllm", "sglang", "speculators", "gguf"):  # no writer for the family: refused, said so
        assert main(["export", str(toy_run), "--to", engine, "--out", str(tmp_path / engine)]) == 2
        assert f"--to {engine} cannot take a toy draft (toy): draftsmith has no {engine} layout" in (
            capsys.readouterr().err
        )

    pub = tmp_path / "pub"
    assert main(["publish", str(toy_run), "--repo-id", "me/toy", "--base-model", "org/target", "--license",
                 "mit", "--no-eval", "--out", str(pub), "--dry-run"]) == 0  # fmt: skip
    card = (pub / "README.md").read_text()
    assert "library_name: draftsmith" in card and "- 3 toy units" in card
    assert 'build_drafter("me/toy", target)' in card  # hf's lines for a family that brings none
    assert "Not served there: draftsmith has no vllm layout for a toy draft" in card
