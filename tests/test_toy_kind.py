"""Adding a kind is its own files plus one registry line: a toy kind whose two modules live in a temporary
folder on the package's path (its record in ``drafts/``, its engine work in ``export/``) and whose only other
trace is its line of ``drafts/base.KINDS`` is found, exported to vLLM by its own writer, verified by its own
check, refused where its record says, and carded with its own section."""

from __future__ import annotations

import json
import sys

import pytest
from tiny import tiny_target

import draftsmith.drafts
import draftsmith.export
from draftsmith.cli import main
from draftsmith.drafts import base, distill
from draftsmith.drafts.engines import VLLM

TOY_DRAFTS = '''
"""The toy kind's record: a small causal LM under a family of its own, served by vLLM alone."""
from draftsmith.drafts.base import DraftKind, Family, register
from draftsmith.drafts.distill import _build, verify_saved
from draftsmith.drafts.engines import HF, VLLM

TOY = Family("toy", "toy draft", verify_hf=verify_saved)
register(DraftKind("toy", "toy draft", _build, TOY, exports=(HF, VLLM), refusal="only vLLM has a toy loader",
                   target_key="draftsmith_target"))
'''

TOY_EXPORT = '''
"""The toy kind's engine work: vLLM's "ToyDraft" folder, its check and the card's section."""
import json

from draftsmith.drafts.engines import VLLM
from draftsmith.export.engines import architecture_is, checked, register_family


def write(ckpt, out, options):
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"architectures": ["ToyDraft"], "kind": ckpt.kind.name}))
    return out


def problems(folder):
    return [] if json.loads((folder / "config.json").read_text()).get("kind") == "toy" else ["kind is not toy"]


def usage(card):
    return ["### vLLM", "", f"vllm serve {card.base_model} --toy-draft {card.repo_id}", ""]


register_family("toy", VLLM, write, usage, (architecture_is("ToyDraft"), checked("toy draft", problems)),
                help="Toy: ToyDraft")
'''


@pytest.fixture
def toy_kind(tmp_path, monkeypatch):
    """The toy kind's two files in a folder on the drafts and export packages' paths, and its one line of
    the registry; all of it forgotten afterwards."""
    folder = tmp_path / "toy_files"
    folder.mkdir()
    (folder / "toykind.py").write_text(TOY_DRAFTS)
    (folder / "toykind_export.py").write_text(TOY_EXPORT)
    monkeypatch.setattr(draftsmith.drafts, "__path__", [*draftsmith.drafts.__path__, str(folder)])
    monkeypatch.setattr(draftsmith.export, "__path__", [*draftsmith.export.__path__, str(folder)])
    monkeypatch.setitem(base.KINDS, "toy", base.KindFiles("toykind", export="toykind_export"))
    try:
        yield
    finally:
        base._KINDS.pop("toy", None)
        for table in (VLLM.writers, VLLM.usages, VLLM.verifiers, VLLM.family_help):
            table.pop("toy", None)
        for name in ("draftsmith.drafts.toykind", "draftsmith.export.toykind_export"):
            sys.modules.pop(name, None)


@pytest.fixture
def toy_run(tmp_path):
    """A small causal LM saved as a draft of the toy kind."""
    target = tiny_target("llama", layers=4)
    run = tmp_path / "toy_run"
    distill.save_draft(
        distill.from_target_layers(target, [0, 1]).eval(), target.tokenizer, target, run / "draft"
    )
    config = json.loads((run / "draft" / "config.json").read_text())
    (run / "draft" / "config.json").write_text(json.dumps({**config, base.DRAFT_KIND_KEY: "toy"}))
    return run


def test_a_kind_from_its_own_files_and_one_registry_line(toy_kind, toy_run, tmp_path, capsys):
    assert base.draft_kind("toy").family.name == "toy" and "toy" in base.kind_names()
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Toy: ToyDraft" in help_text.split("--to sglang")[0]  # its line, in vLLM's paragraph
    assert "toy hf, vllm" in help_text  # and where it goes

    out = tmp_path / "vllm"
    assert main(["export", str(toy_run), "--to", "vllm", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text()) == {"architectures": ["ToyDraft"], "kind": "toy"}
    assert (
        f"toy draft in {out} matches what the vllm loader reads" in capsys.readouterr().out
    )  # its own check
    (out / "config.json").write_text(json.dumps({"architectures": ["ToyDraft"], "kind": "other"}))
    assert main(["export", str(out), "--to", "vllm", "--verify"]) == 2
    assert "kind is not toy" in capsys.readouterr().err

    assert main(["export", str(toy_run), "--to", "sglang", "--out", str(tmp_path / "sglang")]) == 2
    assert "only vLLM has a toy loader" in capsys.readouterr().err  # its record's refusal

    pub = tmp_path / "pub"
    assert main(["publish", str(toy_run), "--repo-id", "me/toy", "--base-model", "org/target", "--license",
                 "mit", "--no-eval", "--out", str(pub), "--dry-run"]) == 0  # fmt: skip
    card = (pub / "README.md").read_text()
    assert "vllm serve org/target --toy-draft me/toy" in card  # its own section, not vLLM's EAGLE-3 one
    assert "Not served there: only vLLM has a toy loader" in card
