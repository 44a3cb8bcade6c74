"""One rule for the target layers every kind taps (drafts/taps.py): ids that exist, strictly increasing, the
last layer allowed in training and refused only at export to an engine that cannot capture it."""

from __future__ import annotations

import json
import re

import pytest
import torch

from draftsmith.drafts.engines import GGUF, HF, SGLANG, SPECULATORS, VLLM
from draftsmith.drafts.taps import check_tap_layers, refuse_uncaptured_last_layer
from draftsmith.train.registry import build_objective
from tests.tiny import tiny_target

TAPPING_KINDS = ("eagle3", "peagle", "dflash")


@pytest.mark.parametrize("kind", TAPPING_KINDS)
@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([2, 0, 1], "must be strictly increasing .*write them as \\[0, 1, 2\\]"),
        ([0, 1, 1], "layer \\[1\\] read twice"),
        ([0, 1, 9], "\\[9\\] outside 0..3 for a target with 4 decoder layers"),
        ([-5, 0, 1], "\\[-5\\] outside 0..3"),
    ],
)
def test_every_kind_refuses_taps_that_break_the_rule_naming_the_fix(kind, ids, match):
    with pytest.raises(ValueError, match=f"draft.options.capture_layer_ids {re.escape(str(ids))}.*{match}"):
        build_objective(kind, tiny_target("llama", layers=4), {"capture_layer_ids": ids})


@pytest.mark.parametrize("kind", TAPPING_KINDS)
def test_every_kind_trains_on_the_last_layer_and_counts_negative_ids_from_it(kind):
    """vLLM captures the last layer's output (aux id L), so training does not refuse it for any kind."""
    objective = build_objective(kind, tiny_target("llama", layers=4), {"capture_layer_ids": [0, 1, -1]})
    assert list(objective.config.capture_layer_ids) == [0, 1, 3]


def test_the_rule_itself():
    assert check_tap_layers([1, -2, -1], 6) == [1, 4, 5]
    with pytest.raises(ValueError, match="is empty"):
        check_tap_layers([], 6)
    for engine in (VLLM, SPECULATORS, HF):
        refuse_uncaptured_last_layer([0, 5], 6, engine)
    for engine in (SGLANG, GGUF):
        refuse_uncaptured_last_layer([0, 4], 6, engine)
        with pytest.raises(ValueError, match=f"last layer .*{engine.title} captures only the inputs"):
            refuse_uncaptured_last_layer([0, 5], 6, engine)


@pytest.fixture(scope="module")
def last_layer_dflash(tmp_path_factory):
    from draftsmith.drafts.dflash import DFlashConfig, DFlashDraft

    target = tiny_target("llama", layers=4)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("dflash") / "draft"
    DFlashDraft(DFlashConfig.for_target(target, block_size=4, capture_layer_ids=[0, 3])).save_pretrained(
        folder
    )
    return target, folder


def test_a_dflash_draft_on_the_last_layer_exports_to_vllm_and_is_refused_by_sglang_and_llamacpp(
    last_layer_dflash, tmp_path
):
    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.export import export_checkpoint, verify_export

    _, folder = last_layer_dflash
    ckpt = locate_checkpoint(str(folder))
    for engine in ("vllm", "speculators"):
        out = export_checkpoint(ckpt, engine, tmp_path / engine)
        verify_export(out, engine)  # raises naming every problem
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["dflash_config"][
        "target_layer_ids"
    ] == [0, 3]
    for engine, title in (("sglang", "SGLang"), ("gguf", "llama.cpp")):
        with pytest.raises(ValueError, match=f"layer id 3 .*last layer .*{title} captures only the inputs"):
            export_checkpoint(ckpt, engine, tmp_path / engine)
        assert not (tmp_path / engine).exists()
