"""bench/step_like_for_like.py's pure parts and its inputs: the subset of a capture in every pipeline's
offline layout, read back as each pipeline's step reads it (draftsmith's cache here; ModelOpt's with its own
reader where its venv exists)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from benchlib import peer_inputs
from test_peer_training import H, fake_capture, run_in_peer

from draftsmith.train.feature_dataset import FeatureCache, collate_cached

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import step_like_for_like as bench  # noqa: E402
from peerbench.data import write_jsonl  # noqa: E402

LAYERS, FINAL = [0, 1, 2], 3  # a 4-layer target: the three captured layers and the last


def test_pack_fills_rows_in_order_and_refuses_a_conversation_longer_than_a_row():
    assert bench.pack([5, 3, 6, 2, 8], 8) == [[0, 1], [2, 3], [4]]
    assert bench.pack([], 8) == []
    try:
        bench.pack([9], 8)
    except ValueError as err:
        assert "more than a row's 8" in str(err)
    else:
        raise AssertionError("a 9-position conversation was packed into an 8-position row")


def test_step_settings_ask_every_pipeline_for_the_same_tokens_in_its_own_words():
    s = bench.step_settings(2048, mean_length=212.6, max_length=512)
    assert s == {
        "draftsmith": ["trainer.batch_size=4"],
        "specforge": ["training.batch_size=10"],
        "speculators": ["total-seq-len=2048"],
        "modelopt": ["training.per_device_train_batch_size=10"],
    }


def test_steady_skips_the_first_steps_and_counts_each_steps_tokens():
    # 10 steps: the first two slow (warm-up), then 2 s each; steady from the end of step 3 (index 2)
    walls = [5.0, 9.0, 11.0, 13.0, 15.0, 17.0, 19.0, 21.0, 23.0, 27.0]
    run = {"step_marks": [[w, w] for w in walls], "step_tokens": [100] * 3 + [2000] * 7,
           "step_positions": [512] * 3 + [4096] * 7}  # fmt: skip
    s = bench.steady(run, {"train": {"positions": 1, "loss_tokens": 1}})
    assert s["steps"] == 10 and s["skipped"] == 3
    assert s["steady_s_per_step"] == (27.0 - 11.0) / 7 and s["median_s_per_step"] == 2.0
    assert s["steady_tokens_per_wall_s"] == 7 * 2000 / 16.0
    assert s["tokens_per_step"] == 2000 and s["positions_per_step"] == 4096
    assert bench.steady({"step_marks": [[1.0, 1.0]]}, {"train": {"positions": 1, "loss_tokens": 1}}) == {
        "steps": 1
    }


def fake_bench_capture(root: Path) -> tuple[list[dict], list[dict]]:
    """A bench/peer_training.py work folder: conversations, budget, counts, both captured layouts."""
    lengths = [5, 3, 6, 2]
    train = [{"input_ids": list(range(10, 10 + n)), "loss_mask": [0] + [1] * (n - 1)} for n in lengths]
    heldout = [{"input_ids": [7, 8, 9, 10, 11, 12, 13], "loss_mask": [0, 0, 1, 1, 1, 1, 1]},
               {"input_ids": [7, 8, 9, 10, 11, 12, 13, 14], "loss_mask": [0] * 8}]  # fmt: skip
    target = root / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": FINAL + 1}))
    data = root / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", train)
    write_jsonl(data / "heldout.jsonl", heldout)
    (data / "vocab_counts.json").write_text(json.dumps({"all": {"10": 4}, "assistant": {"11": 3}}))
    budget = {"target_path": str(target), "max_length": 8, "batch_size": 2, "capture_layers": LAYERS,
              "draftsmith_steps": 9, "train": {}, "heldout": {}}  # fmt: skip
    (data / "budget.json").write_text(json.dumps(budget))
    peer_inputs.write_peer_features(train, heldout, lambda ids: fake_capture(len(ids)), root / "specforge",
                                    root / "speculators", {11: 3})  # fmt: skip
    return train, heldout


def test_the_subset_reads_back_as_the_capture_in_every_layout(tmp_path):
    """The first 3 training and 1 held-out conversations: SpecForge's and speculators' files are the capture's
    own (held-out renumbered after the training ones), ModelOpt's hold the same tensors, and draftsmith's
    offline step reads exactly the captured states: aux layers and the last one, rows packed in order."""
    train, heldout = fake_bench_capture(tmp_path / "capture")
    work = tmp_path / "work"
    budget = bench.subset_work(tmp_path / "capture", work, conversations=3, heldout=1)
    assert budget["train"] == {"positions": 14, "loss_tokens": 11, "conversations": 3}
    assert budget["draftsmith_steps"] == 1  # rows [5 + 3], [6]: one batch of 2

    assert len(list((work / "specforge" / "train").iterdir())) == 3
    assert (work / "speculators" / "hidden_states" / "hs_3.safetensors").resolve() == (
        tmp_path / "capture" / "speculators" / "hidden_states" / "hs_4.safetensors"
    ).resolve()  # the first held-out conversation, after the capture's 4 training ones
    assert json.loads((work / "speculators" / "split.json").read_text()) == {"train": 3, "heldout": 1}

    for split, i in (("train", 2), ("heldout", 0)):
        specforge = torch.load(work / "specforge" / split / f"data_{i:06d}.ckpt", weights_only=True)
        modelopt = torch.load(work / "modelopt" / split / f"data_{i:06d}.pt", weights_only=True)
        assert torch.equal(modelopt["hidden_states"], specforge["hidden_state"][0])
        assert torch.equal(modelopt["aux_hidden_states"], specforge["aux_hidden_state"][0])
        assert torch.equal(modelopt["input_ids"], specforge["input_ids"])
        assert torch.equal(modelopt["loss_mask"], specforge["loss_mask"])

    cache = FeatureCache(work / "draftsmith_cache" / "train")
    assert cache.teacher == "final_state" and cache.layers == [*LAYERS, FINAL] and len(cache) == 2
    batch, teacher = collate_cached([cache[0], cache[1]], pad_id=0, dtype=torch.bfloat16)
    assert teacher.topk_logits is None
    for row, members in enumerate([[0, 1], [2]]):
        convs = [train[i] for i in members]
        n = sum(len(c["input_ids"]) for c in convs)
        assert batch.input_ids[row, :n].tolist() == [t for c in convs for t in c["input_ids"]]
        assert batch.loss_mask[row, :n].tolist() == [m for c in convs for m in c["loss_mask"]]
        assert batch.position_ids[row, :n].tolist() == [p for c in convs for p in range(len(c["input_ids"]))]
        captured = [fake_capture(len(c["input_ids"])) for c in convs]
        aux = torch.cat([a for a, _, _ in captured]).to(torch.bfloat16)
        last = torch.cat([b for _, b, _ in captured]).to(torch.bfloat16)
        for j, layer in enumerate(LAYERS):
            assert torch.equal(teacher.features[layer][row, :n], aux[:, j * H : (j + 1) * H])
        assert torch.equal(teacher.features[FINAL][row, :n], last)
    held = FeatureCache(work / "draftsmith_cache" / "heldout")
    assert len(held) == 1 and held[0]["input_ids"].tolist() == heldout[0]["input_ids"]


@pytest.mark.engine
def test_modelopt_reads_its_offline_layout(tmp_path):
    fake_bench_capture(tmp_path / "capture")
    bench.subset_work(tmp_path / "capture", tmp_path / "work", conversations=3, heldout=1)
    files = sorted(str(p) for p in (tmp_path / "work" / "modelopt" / "train").glob("*.pt"))
    code = f"""
from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset
rows = OfflineSupervisedDataset({files!r}, answer_only_loss=True)
batch = EagleOfflineDataCollator(8)([rows[0], rows[2]])
assert batch["input_ids"][1].tolist() == [10, 11, 12, 13, 14, 15, 0, 0]
assert batch["loss_mask"][1].tolist() == [0, 1, 1, 1, 1, 1, 0, 0]
outputs = batch["base_model_outputs"]
assert outputs["aux_hidden_states"].shape == (2, 8, {3 * H}) and outputs["base_model_hidden_states"].shape == (2, 8, {H})
assert outputs["base_hidden_prenorm"] is False  # the post-norm state: its LM head applies no norm again
print("ok")
"""
    assert "ok" in run_in_peer("modelopt", code)


def test_the_subset_refuses_a_work_folder_it_did_not_write(tmp_path):
    fake_bench_capture(tmp_path / "capture")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    try:
        bench.subset_work(tmp_path / "capture", tmp_path / "work", conversations=3, heldout=1)
    except SystemExit as stop:
        assert "did not write" in str(stop)
    else:
        raise AssertionError("a folder of other files was replaced")
    assert (tmp_path / "work" / "notes.txt").read_text() == "mine"
    bench.subset_work(tmp_path / "capture", tmp_path / "fresh", conversations=3, heldout=1)
    bench.subset_work(tmp_path / "capture", tmp_path / "fresh", conversations=2, heldout=1)  # its own: redone
    assert (
        json.loads((tmp_path / "fresh" / "data" / "budget.json").read_text())["train"]["conversations"] == 2
    )


@pytest.mark.slow
def test_draftsmith_trains_offline_on_the_written_cache_with_the_head_in_the_step(tmp_path):
    """bench/peers/draftsmith_run.py --offline on a subset written from a tiny target's capture: one pass over
    the packed rows in whole batches, each step's tokens counted, validated at the end."""
    import subprocess
    import sys

    from tiny import tiny_model, tiny_tokenizer
    from transformers import AutoModelForCausalLM

    from draftsmith.drafts.eagle import default_eagle3_layers

    target = tmp_path / "target"
    tiny_model("llama", layers=8).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    layers = default_eagle3_layers(8)
    g = torch.Generator().manual_seed(0)
    convs = [{"input_ids": torch.randint(3, 250, (n,), generator=g).tolist(), "loss_mask": [0] * 4 + [1] * (n - 4)}
             for n in (20, 11, 30, 14, 25, 9, 17, 12)]  # fmt: skip
    train, heldout = convs[:6], convs[6:]
    capture = tmp_path / "capture"
    (capture / "data").mkdir(parents=True)
    write_jsonl(capture / "data" / "train.jsonl", train)
    write_jsonl(capture / "data" / "heldout.jsonl", heldout)
    counts = {}
    for c in train:
        for t, m in zip(c["input_ids"], c["loss_mask"]):
            counts[t] = counts.get(t, 0) + m
    (capture / "data" / "vocab_counts.json").write_text(json.dumps({"all": counts, "assistant": counts}))
    budget = {"target_path": str(target), "max_length": 48, "batch_size": 2, "capture_layers": layers,
              "draftsmith_steps": 2, "train": {}, "heldout": {}}  # fmt: skip
    (capture / "data" / "budget.json").write_text(json.dumps(budget))
    peer_inputs.write_peer_features(train, heldout, lambda ids: peer_inputs.capture(model, ids, layers),
                                    capture / "specforge", capture / "speculators", counts)  # fmt: skip
    work = tmp_path / "work"
    bench.subset_work(capture, work, conversations=6, heldout=2)
    rows = len(FeatureCache(work / "draftsmith_cache" / "train"))  # 20+11 | 30+14 | 25+9: 3 rows
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "peers" / "draftsmith_run.py"), "--work", str(work), "--out", str(out),
         "--offline", str(work / "draftsmith_cache"), "--override", "trainer.batch_size=1",
         "--override", "draft.options={num_layers: 1, draft_vocab_size: 64, ttt_steps: 2}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert rows == 3 and result["steps"] == 3 and len(result["step_marks"]) == 3
    assert sorted(result["step_tokens"]) == [31, 34, 44]  # every row once, in the sampler's order
    assert 1.0 <= result["heldout"]["tau"] and "--cache.teacher=final_state" in result["overrides"]
