"""An engine is one record and its writer: a toy engine added from a temporary module is listed by
``export --help``, exported, verified and carded, and what its record refuses is refused with its reason."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
from tiny import tiny_target

from draftsmith.cli import main
from draftsmith.drafts import distill
from draftsmith.drafts.engines import _ENGINES, HF, VLLM, Engine, engine_named, export_engines

TOY_ENGINE = '''
"""A toy engine: its record and its writer, nothing else."""
import json

from draftsmith.drafts.engines import Engine, register_engine

TOY = register_engine(Engine(
    "toy", "Toy Engine", "toy 0.1 (read from its loader)", help="toy.json naming the draft's kind",
    refuses={"medusa": "the toy loader reads no Medusa heads"},
))


def write(ckpt, out, options):
    out.mkdir(parents=True)
    (out / "toy.json").write_text(json.dumps({"kind": ckpt.kind.name, "dtype": options.gguf_dtype}))
    return out


def verify(folder):
    return "toy draft", [] if (folder / "toy.json").is_file() else ["toy.json missing (the toy loader needs it)"]


def usage(card):
    return ["### Toy Engine", "", f"toy serve {card.base_model} --draft {card.repo_id} -k {card.k}", ""]


TOY.writers.update({"causal_lm": write, "medusa": write})
TOY.verify, TOY.usage = verify, usage
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy engine's module imported from a temporary folder, and forgotten afterwards."""
    (tmp_path / "toy_engine.py").write_text(TOY_ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield importlib.import_module("toy_engine").TOY
    finally:
        _ENGINES.pop("toy", None)
        sys.modules.pop("toy_engine", None)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    target = tiny_target("llama", layers=4)
    run = tmp_path_factory.mktemp("small")
    distill.save_draft(
        distill.from_target_layers(target, [0, 1]).eval(), target.tokenizer, target, run / "draft"
    )
    (run / "config.yaml").write_text("draft: {kind: distill}\n")
    return run


def test_a_toy_engine_is_listed_exported_verified_and_carded(toy, small_run, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    help_text = capsys.readouterr().out
    assert "{hf,vllm,sglang,speculators,gguf,toy}" in help_text  # the --to choices
    assert (
        "--to toy" in help_text
        and "checked against toy 0.1" in help_text
        and "medusa draft: the toy" in help_text
    )

    out = tmp_path / "toy-export"
    assert main(["export", str(small_run), "--to", "toy", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert json.loads((out / "toy.json").read_text()) == {"kind": distill.DISTILL, "dtype": "f16"}
    assert f"toy draft in {out} matches what the toy loader reads" in printed
    (out / "toy.json").unlink()
    assert main(["export", str(out), "--to", "toy", "--verify"]) == 2
    assert "toy.json missing" in capsys.readouterr().err

    pub = tmp_path / "pub"
    assert main(["publish", str(small_run), "--repo-id", "me/small", "--base-model", "org/target", "--license",
                 "mit", "--no-eval", "--out", str(pub), "--dry-run"]) == 0  # fmt: skip
    card = (pub / "README.md").read_text()
    assert "### Toy Engine" in card and "toy serve org/target --draft me/small -k 5" in card
    assert card.index("### vLLM") < card.index("### Toy Engine")  # in the order the engines were registered


def test_what_a_record_refuses_is_refused_with_its_reason(toy, tmp_path, capsys):
    from draftsmith.train.registry import build_objective

    target = tiny_target("llama", layers=4)
    objective = build_objective("medusa", target, {"num_heads": 2}, None)
    objective.save(objective.build_draft().eval(), tmp_path / "medusa" / "draft")
    # the toy engine refuses the family; the Medusa kind's record goes to hf alone, and says why
    assert main(["export", str(tmp_path / "medusa"), "--to", "toy", "--out", str(tmp_path / "t")]) == 2
    assert "Medusa loader" in capsys.readouterr().err and not (tmp_path / "t").exists()


def test_an_engine_without_a_writer_and_an_unknown_name_are_clear_errors(tmp_path):
    from draftsmith.drafts.engines import register_engine
    from draftsmith.export import export_checkpoint
    from draftsmith.export.engines import loaded

    bare = register_engine(Engine("bare", "Bare", "nothing", help="nothing yet"))
    try:
        with pytest.raises(ValueError, match="no writer: register one.*draftsmith/export/bare.py"):
            loaded(bare)
        with pytest.raises(ValueError, match="unknown engine 'vlm'. Did you mean 'vllm'"):
            export_checkpoint(None, "vlm", tmp_path)
        with pytest.raises(ValueError, match="registered already"):
            register_engine(Engine("bare", "Bare again", "nothing"))
    finally:
        _ENGINES.pop("bare")


def test_every_engine_has_its_work_and_kinds_name_engines_by_record():
    from draftsmith.drafts.base import draft_kind
    from draftsmith.export.engines import loaded

    for engine in export_engines():
        loaded(engine)
        assert (engine.writers or engine.fallback) and engine.verify and engine.usage and engine.checked, (
            engine
        )
    assert engine_named("hf") is HF
    assert draft_kind("medusa").exports == (HF, VLLM) and draft_kind("eagle1").exports == (HF,)
