"""benchlib.transport: how a head trained on a lent GPU comes back through small files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_target

from draftsmith.drafts.eagle import EagleHead
from draftsmith.train.registry import build_objective


@pytest.fixture(scope="module")
def bench():
    from benchlib import transport

    return transport


def saved_head(target, path: Path) -> Path:
    counts = torch.arange(target.vocab_size).flip(0)
    head = build_objective("eagle3", target, {"draft_vocab_size": 120, "ttt_steps": 2}, counts).build_draft()
    head.save_pretrained(path)
    return path


def test_pack_unpack_round_trip(bench, tmp_path):
    target = tiny_target("llama", layers=4)
    head_dir = saved_head(target, tmp_path / "head")
    # a limit below the LM head's size: it must be cut into row blocks and spread over several files
    files = bench.pack(head_dir, tmp_path / "parts", max_mb=0.005)
    names = {k for f in files for k in load_file(str(f))}
    assert len(files) > 2 and all(f.stat().st_size < 5_000 + 1_000 for f in files)  # 1 KB: the header
    assert {"lm_head.weight@0", "lm_head.weight@1"} <= names and "embed_tokens.weight" not in names

    out = bench.unpack(tmp_path / "parts", tmp_path / "back", target)
    before, after = load_file(str(head_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    for name, value in before.items():
        if name == "embed_tokens.weight" or not value.is_floating_point():
            assert torch.equal(after[name], value), name  # the target's own embedding; exact id maps
        else:  # bfloat16 on the way: 8 significant bits
            torch.testing.assert_close(after[name], value, rtol=2**-8, atol=1e-6)
    assert EagleHead.from_pretrained(out).config.draft_vocab_size == 120


def test_unpack_refuses_a_head_whose_embedding_is_not_the_targets(bench, tmp_path):
    target = tiny_target("llama", layers=4)
    head_dir = saved_head(target, tmp_path / "head")
    bench.pack(head_dir, tmp_path / "parts", max_mb=1)
    other = tiny_target("llama", layers=4, seed=1)
    with pytest.raises(ValueError, match="another token embedding"):
        bench.unpack(tmp_path / "parts", tmp_path / "back", other)
    (tmp_path / "parts" / "head-00.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="0 of the 1 head files"):
        bench.unpack(tmp_path / "parts", tmp_path / "back", target)
