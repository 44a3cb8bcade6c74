"""Which kinds train and by which objective module: their line of the one registry (``drafts/base.KINDS``, a bare
module name, so drafts/ names no train module), resolved by train's registry."""

from __future__ import annotations

import importlib

import pytest

from draftsmith.drafts.base import KINDS, KindFiles, draft_kind, kind_names
from draftsmith.train import registry
from draftsmith.train.registry import (
    check_kind,
    check_objective_options,
    objective_kinds,
    objective_module,
)

TRAINABLE = sorted(kind for kind, files in KINDS.items() if files.objective)


@pytest.mark.parametrize("kind", TRAINABLE)
def test_each_trainable_kind_is_a_draft_kind_its_module_registers(kind):
    assert draft_kind(kind).name == kind
    importlib.import_module(objective_module(kind))
    assert kind in registry._OBJECTIVES  # a registry line naming the wrong module would leave it out


def test_every_kind_either_trains_or_says_it_needs_no_training():
    untrainable = [k for k in kind_names() if k not in TRAINABLE]
    assert untrainable and set(objective_kinds()) >= set(TRAINABLE)
    for kind in untrainable:
        for check in (check_kind, lambda kind: check_objective_options(kind, {})):
            with pytest.raises(ValueError, match=rf"draft.kind '{kind}' is a .*needs no training. Trainable"):
                check(kind)


def test_an_unknown_kind_names_the_closest_trainable_one():
    for check in (check_kind, lambda kind: check_objective_options(kind, {})):
        with pytest.raises(ValueError, match=r"unknown key 'eagle4' in draft.kind.*Did you mean 'eagle3'"):
            check("eagle4")


def test_a_module_that_registers_nothing_is_named(monkeypatch):
    monkeypatch.setitem(KINDS, "ngram", KindFiles("ngram", objective="common"))
    with pytest.raises(
        RuntimeError, match=r"draftsmith.train.objectives.common registers no objective.*'ngram'"
    ):
        check_objective_options("ngram", {})


def test_options_are_typed_checked_with_the_fix_and_listed_in_help(capsys):
    from draftsmith.cli import main
    from draftsmith.drafts.base import DISTILL, EAGLE3, MEDUSA, MIRROR

    with pytest.raises(ValueError, match=r"unknown key 'draft.options.num_head'.*Did you mean 'num_heads'"):
        check_objective_options(MEDUSA, {"num_head": 3})
    with pytest.raises(ValueError, match=r"'medusa': draft.options.num_heads must be >= 1, got 0"):
        check_objective_options(MEDUSA, {"num_heads": 0})
    with pytest.raises(ValueError, match=r"draft.options.ttt_steps: input should be a valid integer.*'many'"):
        check_objective_options(EAGLE3, {"ttt_steps": "many"})
    with pytest.raises(ValueError, match=r"draft.options.loss is 'kl'; choose one of 'fkl', 'rkl'"):
        check_objective_options(DISTILL, {"loss": "kl"})
    with pytest.raises(ValueError, match=r"kappa must be >= 1"):
        check_objective_options(MIRROR, {"kappa": 0})
    check_objective_options(MIRROR, {"kappa": 2, "ttt_steps": 2})  # EAGLE-3's options and its own

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    medusa = out[out.index("draft.options of kind medusa:") :]
    assert "num_heads  (int >= 1, default 4)" in medusa and "Residual blocks per head." in medusa
    mirror = out[out.index("draft.options of kind mirror:") :]
    assert "Decoder layers in the head" in mirror.split("early_exit_layer")[0]  # inherited, still described
