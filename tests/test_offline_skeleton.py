"""Offline training with a complete feature cache never builds the target's layers: the draft's copies of the
embedding, final norm and LM head are read from the target's safetensors by name (one file or shards, tied
or not), and the run trains exactly as it does with the whole target loaded."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import logged_losses
from test_loop import QUIET, Probe, conversations, make_config  # noqa: F401 (fixture)
from test_resume import run_worker
from tiny import tiny_model, tiny_tokenizer

from draftsmith.decode.target import load_target, load_target_skeleton
from draftsmith.train.loop import train

EAGLE3 = ("--draft.kind=eagle3", "--draft.options={draft_vocab_size: 64, ttt_steps: 2}", "--optim.lr=1e-3",
          "--mode=offline", "--trainer.max_steps=3", "--trainer.val_k=2", "--trainer.val_every=2")  # fmt: skip


def saved_target(path, tied: bool = False, shard: str | None = None):
    model = tiny_model("llama", layers=2, **({"tie_word_embeddings": True} if tied else {}))
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("tied, shard", [(False, None), (True, "30KB")])
def test_skeleton_holds_the_output_side_and_nothing_else(tmp_path, tied, shard):
    path = saved_target(tmp_path / "target", tied, shard)
    assert (path / "model.safetensors.index.json").exists() == bool(shard)
    whole, skeleton = load_target(str(path), device="cpu"), load_target_skeleton(str(path))
    assert skeleton.record() == whole.record() and skeleton.dtype == whole.dtype and not skeleton.materialized
    for part in (lambda t: t.model.get_input_embeddings(), lambda t: t.model.model.norm,
                 lambda t: t.model.get_output_embeddings()):  # fmt: skip
        assert torch.equal(part(skeleton).weight, part(whole).weight)
    assert (skeleton.model.lm_head.weight is skeleton.model.model.embed_tokens.weight) == tied
    assert all(p.is_meta for p in skeleton.model.model.layers.parameters())


def test_a_complete_cache_trains_without_the_targets_layers(conversations, tmp_path, monkeypatch, capsys):  # noqa: F811
    target = saved_target(tmp_path / "target")
    cache = f"--cache.dir={tmp_path / 'cache'}"
    whole = train(make_config(target, conversations, tmp_path / "whole", *EAGLE3, cache), **QUIET)
    assert "is complete" not in capsys.readouterr().out  # the first run captured it

    monkeypatch.setattr(
        "draftsmith.train.loop.load_target", lambda *a, **k: pytest.fail("the whole target was loaded")
    )
    probe = Probe()
    again = train(
        make_config(target, conversations, tmp_path / "skeleton", *EAGLE3, cache), callbacks=[probe], **QUIET
    )
    assert "the target's layers are not loaded" in capsys.readouterr().out
    layers = {id(p) for p in probe.objective.target.model.model.layers.parameters()}
    assert layers and all(p.is_meta for p in probe.target_params if id(p) in layers)  # never given memory
    ours, theirs = logged_losses(tmp_path / "skeleton"), logged_losses(tmp_path / "whole")
    assert sorted(ours) == sorted(theirs) == [0, 1, 2]
    for step, loss in theirs.items():
        assert ours[step] == pytest.approx(loss, abs=1e-6, rel=0), (step, ours, theirs)
    assert again.val["tau"] == pytest.approx(whole.val["tau"], abs=1e-6)
    ours, theirs = (load_file(str(r.draft_dir / "model.safetensors")) for r in (again, whole))
    assert sorted(ours) == sorted(theirs)
    for (
        name,
        value,
    ) in theirs.items():  # the copies of the target's output side and all that trained from them
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6)


def test_a_draft_made_of_the_targets_layers_loads_them(conversations, tmp_path, capsys):  # noqa: F811
    """distill's default init copies target layers into the draft: with a complete cache the whole target
    still loads, and the run trains."""
    target = saved_target(tmp_path / "target")
    flags = ("--draft.kind=distill", "--draft.options={num_layers: 1}", "--mode=offline", "--trainer.max_steps=1",
             f"--cache.dir={tmp_path / 'cache'}")  # fmt: skip
    train(make_config(target, conversations, tmp_path / "a", *flags), **QUIET)
    result = train(make_config(target, conversations, tmp_path / "b", *flags), **QUIET)
    out = capsys.readouterr().out
    assert "is complete" in out and "layers are not loaded" not in out and result.steps == 1


@pytest.mark.slow
def test_two_ranks_train_from_a_complete_cache_without_the_targets_layers(conversations, tmp_path):  # noqa: F811
    """2 gloo ranks: a first run captures the cache sharded over the ranks with the whole target; a second,
    in which loading the whole target raises on every rank, trains to the same losses."""
    target = saved_target(tmp_path / "target")
    # 5 steps of 2 ranks x 4 rows read every training row (a run reading fewer: tests/test_distributed.py)
    flags = (*EAGLE3, f"--cache.dir={tmp_path / 'cache'}", "--trainer.strategy=ddp", "--trainer.devices=2",
             "--trainer.batch_size=4", "--trainer.max_steps=5", "--cache.examples_per_shard=4")  # fmt: skip
    first = run_worker(target, conversations, tmp_path / "whole", *flags, timeout=240)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    second = run_worker(
        target, conversations, tmp_path / "skeleton", *flags, "--no-target-layers", timeout=300
    )
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "the target's layers are not loaded" in second.stdout
    both = second.stdout + second.stderr  # two ranks write to one pipe: their lines may share a line
    assert all(f"rank {rank}: target layers on meta" in both for rank in (0, 1)), both[-3000:]
    ours, theirs = logged_losses(tmp_path / "skeleton"), logged_losses(tmp_path / "whole")
    assert sorted(ours) == sorted(theirs) == [0, 1, 2, 3, 4]
    for step, loss in theirs.items():
        assert ours[step] == pytest.approx(loss, abs=1e-6, rel=0), (step, ours, theirs)
