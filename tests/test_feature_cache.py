"""Offline feature cache: written once, read back equal to the online teacher, resumable, trainable."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from test_loop import QUIET, Probe, conversations, make_config, tiny_target_dir  # noqa: F401 (fixtures)
from tiny import tiny_target

from draftsmith.train.corpus.tokens import build_dataset, collate
from draftsmith.train.feature_cache import build_feature_cache, bytes_per_token
from draftsmith.train.feature_dataset import FeatureCache, collate_cached
from draftsmith.train.loop import train
from draftsmith.train.teacher import compute_teacher

LAYERS, TOPK = (0, 1), 5


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=2)


@pytest.fixture(scope="module")
def rows(target, conversations):  # noqa: F811
    return build_dataset([conversations], target.tokenizer, max_length=48, seed=0).select(range(11))


def test_cache_reads_back_the_online_teacher(target, rows, tmp_path, capsys):
    cache_dir = build_feature_cache(
        target, rows, tmp_path / "cache", LAYERS, TOPK, examples_per_shard=4, batch_size=3
    )
    printed = capsys.readouterr().out
    per_token = bytes_per_token(32, len(LAYERS), TOPK, torch.bfloat16)
    assert f"{per_token:,} bytes/token" in printed and "3 shards" in printed
    assert sorted(p.name for p in cache_dir.glob("shard-*")) == [
        f"shard-0000{i}.safetensors" for i in range(3)
    ]

    cache = FeatureCache(cache_dir)
    assert len(cache) == len(rows)
    picks = [0, 5, 10]  # one example from each shard
    batch, teacher = collate_cached([cache[i] for i in picks], pad_id=0, dtype=target.dtype)
    online_batch = collate([rows[i] for i in picks], pad_id=0)
    online = compute_teacher(target, online_batch, LAYERS, TOPK)

    assert torch.equal(batch.input_ids, online_batch.input_ids)
    assert torch.equal(batch.loss_mask, online_batch.loss_mask)
    assert torch.equal(batch.attention_mask, online_batch.attention_mask)
    real = batch.attention_mask.bool()
    for layer in LAYERS:
        got, want = teacher.features[layer][real], online.features[layer][real]
        assert got.dtype == target.dtype
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)  # bf16 rounding
    torch.testing.assert_close(teacher.topk_logits[real], online.topk_logits[real], rtol=2**-7, atol=1e-5)
    assert torch.equal(teacher.topk_ids[real], online.topk_ids[real])


def test_cache_resumes_and_refuses_a_different_cache(target, rows, tmp_path, capsys):
    cache_dir = build_feature_cache(target, rows, tmp_path / "cache", LAYERS, TOPK, examples_per_shard=4)
    stamps = {p.name: p.stat().st_mtime_ns for p in cache_dir.glob("shard-*")}
    (cache_dir / "shard-00001.safetensors").unlink()  # as if the run died while writing it
    capsys.readouterr()
    build_feature_cache(target, rows, cache_dir, LAYERS, TOPK, examples_per_shard=4)
    assert "2 of 3 shards already complete" in capsys.readouterr().out
    after = {p.name: p.stat().st_mtime_ns for p in cache_dir.glob("shard-*")}
    assert set(after) == set(stamps) and not list(cache_dir.glob(".*tmp*"))
    assert after["shard-00000.safetensors"] == stamps["shard-00000.safetensors"]
    assert after["shard-00002.safetensors"] == stamps["shard-00002.safetensors"]

    with pytest.raises(ValueError, match="topk"):
        build_feature_cache(target, rows, cache_dir, LAYERS, TOPK + 1, examples_per_shard=4)


def test_incomplete_cache_is_an_error(target, rows, tmp_path):
    cache_dir = build_feature_cache(target, rows, tmp_path / "cache", LAYERS, TOPK, examples_per_shard=4)
    (cache_dir / "shard-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard-00002"):
        FeatureCache(cache_dir)


def test_offline_training_runs(tiny_target_dir, conversations, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    config = make_config(tiny_target_dir, conversations, out, "--mode=offline", "--trainer.max_steps=4")
    probe = Probe()
    result = train(config, callbacks=[probe], **QUIET)
    assert result.steps == 4 and (out / "feature_cache" / "train" / "cache.json").exists()
    assert (result.draft_dir / "model.safetensors").exists()
    losses = probe.objective.train_losses
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_a_short_offline_run_caches_only_the_rows_it_reads(tiny_target_dir, conversations, tmp_path, capsys):  # noqa: F811
    """2 steps of 4 rows read 8 of the 20 training rows: the cache holds those (two shards of 4), and a
    longer run in the same cache folder reuses both shards and adds only what it reads beyond them."""
    cache, flags = tmp_path / "cache", ("--mode=offline", "--cache.examples_per_shard=4")
    short = make_config(tiny_target_dir, conversations, tmp_path / "a", *flags, f"--cache.dir={cache}",
                        "--trainer.max_steps=2")  # fmt: skip
    train(short, **QUIET)
    assert "steps read 8 of the 20 training rows; caching 8" in capsys.readouterr().out
    assert len(FeatureCache(cache / "train")) == 8
    longer = make_config(tiny_target_dir, conversations, tmp_path / "b", *flags, f"--cache.dir={cache}",
                         "--trainer.max_steps=3")  # fmt: skip
    result = train(longer, **QUIET)
    out = capsys.readouterr().out
    assert "caching 12" in out and "2 of 3 shards already complete" in out and result.steps == 3
    assert len(FeatureCache(cache / "train")) == 12
    whole = make_config(tiny_target_dir, conversations, tmp_path / "c", *flags, "--trainer.max_steps=5")
    train(whole, **QUIET)
    assert "caching" not in capsys.readouterr().out  # 5 steps read every row: all of them are cached
    assert len(FeatureCache(tmp_path / "c" / "feature_cache" / "train")) == 20


def test_full_logits_cache_stores_no_ids(target, rows, tmp_path):
    from safetensors import safe_open

    cache_dir = build_feature_cache(target, rows, tmp_path / "full", (1,), 10**6, examples_per_shard=8)
    with safe_open(str(cache_dir / "shard-00000.safetensors"), "pt") as f:
        assert "topk_ids" not in f.keys() and f.get_slice("topk_logits").get_shape()[-1] == target.vocab_size
    batch, teacher = collate_cached([FeatureCache(cache_dir)[9]], pad_id=0)
    online = compute_teacher(target, batch, (1,), target.vocab_size)
    assert torch.equal(teacher.topk_ids, online.topk_ids)  # 0..V-1 at every position
    torch.testing.assert_close(teacher.topk_logits, online.topk_logits, rtol=2**-7, atol=1e-5)


def test_cache_written_by_two_ranks_reads_back_complete(rows, tmp_path, capsys):
    """Two ranks (threads here, each with its own copy of the target) split the shards; the cache then
    holds every example once, and the by-shard training order gives each rank the shards it wrote."""
    import threading

    from tiny import tiny_target

    from draftsmith.train.sampler import ResumableSampler

    rows12 = rows.select(range(10)).add_item(rows[0]).add_item(rows[1])  # 12 rows -> 4 shards of 3
    cache_dir, errors = tmp_path / "cache", []

    def rank(r: int) -> None:
        try:
            build_feature_cache(
                tiny_target("llama", layers=2), rows12, cache_dir, LAYERS, TOPK, examples_per_shard=3,
                rank=r, world_size=2, wait_timeout=60,
            )  # fmt: skip
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert "4 shards over 2 ranks" in capsys.readouterr().out
    cache = FeatureCache(cache_dir)
    assert len(cache) == 12 and cache.shard_sizes == [3, 3, 3, 3]
    for i in range(12):  # complete and in order: example i is row i
        assert cache[i]["input_ids"].tolist() == rows12[i]["input_ids"]
    seen = [
        list(ResumableSampler(12, batch_size=2, shard_sizes=cache.shard_sizes, rank=r, world_size=2))
        for r in (0, 1)
    ]
    assert sorted(seen[0] + seen[1]) == list(range(12))  # each example once, across the two readers
    assert {i // 3 for i in seen[0]} == {0, 2} and {i // 3 for i in seen[1]} == {1, 3}  # the shards it wrote


def test_other_rank_that_never_writes_is_a_clear_timeout(target, rows, tmp_path):
    with pytest.raises(TimeoutError, match="shard-00001"):
        build_feature_cache(target, rows, tmp_path / "c", LAYERS, TOPK, examples_per_shard=4, rank=0,
                            world_size=2, wait_timeout=0.5)  # fmt: skip


def test_float8_cache_is_smaller_and_close(target, rows, tmp_path, capsys):
    cache_dir = build_feature_cache(
        target, rows, tmp_path / "fp8", LAYERS, TOPK, examples_per_shard=8, feature_dtype="float8"
    )
    per_token = bytes_per_token(32, len(LAYERS), TOPK, torch.float8_e4m3fn)
    assert per_token < bytes_per_token(32, len(LAYERS), TOPK, torch.bfloat16)
    assert f"{per_token:,} bytes/token" in capsys.readouterr().out
    picks = [0, 9]
    batch, teacher = collate_cached(
        [FeatureCache(cache_dir)[i] for i in picks], pad_id=0, dtype=torch.float32
    )
    online = compute_teacher(target, collate([rows[i] for i in picks], pad_id=0), LAYERS, TOPK)
    real = batch.attention_mask.bool()
    for layer in LAYERS:
        got, want = teacher.features[layer][real], online.features[layer][real]
        scale = want.abs().amax(-1, keepdim=True)
        assert ((got - want).abs() <= scale / 8).all()  # e4m3: 3 mantissa bits, relative to each token's max
        assert not torch.equal(got, want)


def test_packed_rows_keep_their_conversation_boundaries(target, conversations, tmp_path):  # noqa: F811
    """Offline training on packed rows needs position_ids back, or the head would attend across
    conversations that the teacher kept apart."""
    packed = build_dataset([conversations], target.tokenizer, max_length=96, pack=True, seed=0).select(
        range(4)
    )
    assert any(0 in row["position_ids"][1:] for row in packed)  # some row really holds two conversations
    cache = FeatureCache(build_feature_cache(target, packed, tmp_path / "cache", LAYERS, TOPK, batch_size=2))
    batch, teacher = collate_cached([cache[i] for i in range(4)], pad_id=0, dtype=target.dtype)
    online_batch = collate([packed[i] for i in range(4)], pad_id=0)
    assert torch.equal(batch.position_ids, online_batch.position_ids)
    online = compute_teacher(target, online_batch, LAYERS, TOPK)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(teacher.features[1][real], online.features[1][real], rtol=2**-7, atol=1e-5)


def test_a_final_state_cache_gives_the_logits_caches_teacher_in_the_step(target, rows, tmp_path):
    """cache.teacher final_state stores the last layer's output and no logits; the step's final norm + LM
    head over it give the top-k the logits cache stores (to bf16 rounding: both read bf16 values)."""
    from safetensors import safe_open

    from draftsmith.train.teacher import final_layer, teacher_from_final_state

    logits = build_feature_cache(target, rows, tmp_path / "logits", LAYERS, TOPK, examples_per_shard=8)
    state = build_feature_cache(
        target, rows, tmp_path / "state", LAYERS[:1], TOPK, examples_per_shard=8, teacher="final_state"
    )
    with safe_open(str(state / "shard-00000.safetensors"), "pt") as f:
        assert f.get_slice("topk_logits").get_shape()[-1] == 0
        assert f"features.{final_layer(target)}" in f.keys()
    picks = [0, 5, 10]
    batch, want = collate_cached([FeatureCache(logits)[i] for i in picks], pad_id=0, dtype=target.dtype)
    same, cached = collate_cached([FeatureCache(state)[i] for i in picks], pad_id=0, dtype=target.dtype)
    assert torch.equal(batch.input_ids, same.input_ids) and cached.topk_logits is None
    got = teacher_from_final_state(target, cached, LAYERS[:1], TOPK)
    real = batch.attention_mask.bool()
    assert list(got.features) == [LAYERS[0]]  # the last layer only fed the head
    torch.testing.assert_close(got.features[0], want.features[0])
    assert (got.topk_ids[real] == want.topk_ids[real]).float().mean() > 0.95  # near-ties may swap
    torch.testing.assert_close(got.topk_logits[real].max(-1).values, want.topk_logits[real].max(-1).values,
                               rtol=2**-6, atol=2e-3)  # fmt: skip
    with pytest.raises(ValueError, match="teacher"):  # a cache of the other kind is refused, not mixed
        build_feature_cache(target, rows, logits, LAYERS, TOPK, examples_per_shard=8, teacher="final_state")


class _Losses(L.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_offline_eagle3_trains_alike_from_a_final_state_cache(tiny_target_dir, conversations, tmp_path):  # noqa: F811
    """The same offline EAGLE-3 run from a logits cache and from a final_state cache (the teacher computed in
    each step): the same losses to bf16 tolerance."""
    runs = {}
    for teacher in ("logits", "final_state"):
        config = make_config(
            tiny_target_dir, conversations, tmp_path / teacher, "--mode=offline", "--draft.kind=eagle3",
            "--draft.options={draft_vocab_size: 64, ttt_steps: 2}", "--optim.lr=1e-3", "--trainer.max_steps=3",
            "--trainer.val_k=2", f"--cache.teacher={teacher}",
        )  # fmt: skip
        runs[teacher] = _Losses()
        train(config, callbacks=[runs[teacher]], **QUIET)
    assert len(runs["final_state"].losses) == 3
    torch.testing.assert_close(runs["final_state"].losses, runs["logits"].losses, rtol=2e-2, atol=1e-3)
