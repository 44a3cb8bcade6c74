"""train/'s registry owns which kinds train and by which objective module; drafts/ names no train module."""

from __future__ import annotations

import importlib

import pytest

from draftsmith.drafts.base import draft_kind, kind_names
from draftsmith.train import registry
from draftsmith.train.registry import OBJECTIVE_MODULES, check_kind, check_objective_options, objective_kinds


@pytest.mark.parametrize("kind", sorted(OBJECTIVE_MODULES))
def test_each_trainable_kind_is_a_draft_kind_its_module_registers(kind):
    assert draft_kind(kind).name == kind
    importlib.import_module(OBJECTIVE_MODULES[kind])
    assert kind in registry._OBJECTIVES  # a map entry naming the wrong module would leave it out


def test_every_kind_either_trains_or_says_it_needs_no_training():
    untrainable = [k for k in kind_names() if k not in OBJECTIVE_MODULES]
    assert untrainable and set(objective_kinds()) >= set(OBJECTIVE_MODULES)
    for kind in untrainable:
        for check in (check_kind, lambda kind: check_objective_options(kind, {})):
            with pytest.raises(ValueError, match=rf"draft.kind '{kind}' is a .*needs no training. Trainable"):
                check(kind)


def test_an_unknown_kind_names_the_closest_trainable_one():
    for check in (check_kind, lambda kind: check_objective_options(kind, {})):
        with pytest.raises(ValueError, match=r"unknown key 'eagle4' in draft.kind.*Did you mean 'eagle3'"):
            check("eagle4")


def test_a_module_that_registers_nothing_is_named(monkeypatch):
    monkeypatch.setitem(OBJECTIVE_MODULES, "ngram", "draftsmith.train.objectives.common")
    with pytest.raises(
        RuntimeError, match=r"draftsmith.train.objectives.common registers no objective.*'ngram'"
    ):
        check_objective_options("ngram", {})
