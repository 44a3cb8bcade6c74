"""bench/peer_training.py's pure parts (bench/peerbench/) and bench/benchlib/peer_inputs.py: the token budget, the
conversations, each peer's input layout.

The layouts are read back by the peers' own readers where their venvs exist (``bash
scripts/install_peers.sh``); without them those tests skip and the rest runs on draftsmith alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchlib import peer_inputs

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from peerbench import common, training  # noqa: E402
from peerbench.data import read_jsonl, read_vocab_counts, write_jsonl  # noqa: E402

PEERS_ROOT = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")) / "peers"
H = 8  # hidden size of the fake captures


def test_steps_for_budget_rounds_up_to_whole_batches():
    lengths = [500] * 10
    assert peer_inputs.steps_for_budget(lengths, 1500, batch_size=4) == 1  # 3 rows
    assert peer_inputs.steps_for_budget(lengths, 1501, batch_size=4) == 1  # 4 rows
    assert peer_inputs.steps_for_budget(lengths, 2001, batch_size=4) == 2  # 5 rows
    assert peer_inputs.steps_for_budget(lengths, 5000, batch_size=2) == 5
    with pytest.raises(ValueError, match="fewer than"):
        peer_inputs.steps_for_budget(lengths, 5001, batch_size=4)
    with pytest.raises(ValueError, match="positive"):
        peer_inputs.steps_for_budget(lengths, 0, batch_size=4)


def test_sampler_order_is_the_training_loops_order_across_epochs():
    from draftsmith.train.sampler import ResumableSampler

    sampler = ResumableSampler(10, 4, seed=3, rank=0, world_size=1)
    first = list(iter(sampler))  # 8 rows: whole batches only
    sampler.epoch = 1
    second = list(iter(sampler))
    assert peer_inputs.sampler_order(10, 4, seed=3, count=12) == first + second[:4]
    assert len(set(first)) == 8


def test_conversations_of_splits_packed_rows_where_positions_restart():
    row = {
        "input_ids": [1, 2, 3, 4, 5, 6],
        "loss_mask": [0, 1, 1, 0, 0, 1],
        "position_ids": [0, 1, 2, 0, 1, 2],
    }
    convs = peer_inputs.conversations_of(row)
    assert convs == [
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
        {"input_ids": [4, 5, 6], "loss_mask": [0, 0, 1]},
    ]
    assert peer_inputs.token_counts(convs) == {"positions": 6, "loss_tokens": 3, "conversations": 2}
    assert peer_inputs.conversations_of({"input_ids": [7, 8], "loss_mask": [1, 1]}) == [
        {"input_ids": [7, 8], "loss_mask": [1, 1]}
    ]
    with pytest.raises(ValueError, match="position 0"):
        peer_inputs.conversations_of({"input_ids": [1, 2], "loss_mask": [0, 1], "position_ids": [3, 4]})


def test_throughput_counts_steady_state_between_step_marks():
    budget = {"train": {"positions": 1000, "loss_tokens": 400}}
    marks = [(10.0, 20.0), (12.0, 24.0), (14.0, 28.0), (15.0, 30.0), (16.0, 32.0)]  # (wall, cpu) per step
    rates = training.throughput({"wall_s": 20.0, "cpu_s": 40.0, "step_marks": marks}, budget)
    assert rates["tokens_per_wall_s"] == 50.0 and rates["tokens_per_cpu_s"] == 25.0
    assert rates["loss_tokens_per_wall_s"] == 20.0
    # 200 positions a step; with fewer than 8 steps, steps 2-5 count: 600 positions in 4 s wall, 8 s CPU
    assert rates["steady_tokens_per_wall_s"] == pytest.approx(150.0)
    assert rates["steady_tokens_per_cpu_s"] == pytest.approx(75.0)
    counted = {"wall_s": 20.0, "cpu_s": 40.0, "step_marks": marks, "step_tokens": [500, 100, 100, 100, 200]}
    steady = training.throughput(counted, budget)["steady_tokens_per_wall_s"]
    assert steady == pytest.approx(100.0)  # the counted tokens of steps 3-5 (400) in 4 s
    eight = [(float(i), 2.0 * i) for i in range(8)]  # from 8 steps on, the first two are left out
    assert training.throughput({"wall_s": 8.0, "cpu_s": 16.0, "step_marks": eight}, budget)[
        "steady_s_per_step"
    ] == pytest.approx(1.0)
    assert "steady_tokens_per_wall_s" not in training.throughput({"wall_s": 1.0, "cpu_s": 1.0}, budget)


def fake_capture(T: int):
    torch.manual_seed(T)
    return torch.randn(T, 3 * H), torch.randn(T, H), torch.randn(T, H)


def test_specforge_and_speculators_records_hold_the_capture(tmp_path):
    from safetensors.torch import load_file, save_file

    conv = {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}
    aux, last, normed = fake_capture(4)
    torch.save(peer_inputs.specforge_record(conv, aux, normed), tmp_path / "data_000000.ckpt")
    back = torch.load(tmp_path / "data_000000.ckpt", weights_only=True)
    assert set(back) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert back["input_ids"].tolist() == conv["input_ids"] and back["loss_mask"].tolist() == conv["loss_mask"]
    assert back["aux_hidden_state"].shape == (1, 4, 3 * H) and back["hidden_state"].shape == (1, 4, H)
    assert torch.equal(back["hidden_state"][0], normed.to(torch.bfloat16))

    save_file(peer_inputs.speculators_record(conv, aux, last), tmp_path / "hs_0.safetensors")
    hs = load_file(tmp_path / "hs_0.safetensors")
    assert hs["token_ids"].tolist() == conv["input_ids"] and hs["hidden_states"].shape == (4, 4, H)
    # what speculators' ArrowDataset reads out of it
    assert torch.equal(hs["hidden_states"][:, :-1].flatten(1), aux.to(torch.bfloat16))
    assert torch.equal(hs["hidden_states"][:, -1], last.to(torch.bfloat16))


def write_layouts(work: Path) -> tuple[list[dict], list[dict]]:
    """A tiny bench work folder: conversations, vocabulary counts, both capture layouts."""
    train = [
        {"input_ids": [3, 4, 5, 6, 7], "loss_mask": [0, 1, 1, 1, 1]},
        {"input_ids": [3, 9, 9], "loss_mask": [0, 0, 1]},
    ]
    heldout = [{"input_ids": [3, 4, 8, 8], "loss_mask": [0, 1, 1, 1]}]
    (work / "data").mkdir(parents=True)
    write_jsonl(work / "data" / "train.jsonl", train)
    write_jsonl(work / "data" / "heldout.jsonl", heldout)
    counts = {"all": {3: 3, 4: 1, 5: 1, 6: 1, 7: 1, 9: 2}, "assistant": {4: 1, 5: 1, 6: 1, 7: 1, 9: 1}}
    (work / "data" / "vocab_counts.json").write_text(json.dumps(counts))
    assistant = read_vocab_counts(work)["assistant"]
    peer_inputs.write_peer_features(
        train,
        heldout,
        lambda ids: fake_capture(len(ids)),
        work / "specforge",
        work / "speculators",
        assistant,
    )
    return train, heldout


def test_layouts_read_back(tmp_path):
    import datasets

    train, heldout = write_layouts(tmp_path)
    assert read_jsonl(tmp_path / "data" / "train.jsonl") == train
    assert read_vocab_counts(tmp_path)["all"][9] == 2
    sp = tmp_path / "speculators"
    ds = datasets.load_from_disk(str(sp))
    assert len(ds) == 3 and ds.format["type"] == "torch"
    assert ds[2]["input_ids"].tolist() == heldout[0]["input_ids"]
    assert [int(n) for n in ds["seq_len"]] == [5, 3, 4]
    assert json.loads((sp / "split.json").read_text()) == {"train": 2, "heldout": 1}
    assert torch.load(sp / "token_freq.pt") == {4: 1, 5: 1, 6: 1, 7: 1, 9: 1}


def test_a_capture_stopped_part_way_goes_on_from_its_files_and_another_capture_starts_over(tmp_path):
    """The capture (an hour at 1.6M tokens here) resumes: a run killed after two conversations leaves those two
    whole and no index; the run again under the same stamp captures only the rest and writes what an unbroken
    capture writes; under another stamp (another dtype, other data) everything is captured afresh."""
    from safetensors.torch import load_file

    train = [{"input_ids": [3, 4, 5, 6, 7], "loss_mask": [0, 1, 1, 1, 1]}, {"input_ids": [3, 9, 9], "loss_mask": [0, 0, 1]},
             {"input_ids": [3, 5, 5, 5], "loss_mask": [0, 1, 1, 1]}]  # fmt: skip
    heldout = [{"input_ids": [3, 4, 8, 8], "loss_mask": [0, 1, 1, 1]}]
    seen: list[int] = []

    def captured(ids, stop_after=None):
        if stop_after is not None and len(seen) == stop_after:
            raise KeyboardInterrupt  # the job killed between two conversations
        seen.append(len(ids))
        return fake_capture(len(ids))

    def write(root, stamp, stop_after=None):
        return peer_inputs.write_peer_features(train, heldout, lambda ids: captured(ids, stop_after), root / "specforge",
                                               root / "speculators", {4: 1}, stamp=stamp)  # fmt: skip

    whole = tmp_path / "whole"
    assert write(whole, {"dtype": "float32"}) == (16, 16)
    part = tmp_path / "part"
    seen.clear()
    with pytest.raises(KeyboardInterrupt):
        write(part, {"dtype": "float32"}, stop_after=2)
    assert not (part / "speculators" / "split.json").exists()
    assert len(list((part / "speculators" / "hidden_states").iterdir())) == 2
    seen.clear()
    assert write(part, {"dtype": "float32"}) == (16, 8) and seen == [4, 4]  # the third and the held-out one
    for name in (
        "specforge/train/data_000002.ckpt",
        "specforge/heldout/data_000000.ckpt",
        "speculators/split.json",
    ):
        assert (part / name).read_bytes() == (whole / name).read_bytes()
    for i in range(4):
        a, b = (load_file(r / "speculators" / "hidden_states" / f"hs_{i}.safetensors") for r in (part, whole))
        assert all(torch.equal(a[k], b[k]) for k in a)
    seen.clear()
    assert write(part, {"dtype": "bfloat16"}) == (16, 16) and seen == [5, 3, 4, 4]


@pytest.mark.engine
def test_specforge_stand_in_loss_is_the_kernels_loss():
    """bench/peers/specforge_run.py's torch LogSoftmaxLoss against the sum its Triton kernels compute, by hand."""
    code = """
import torch, specforge_run
torch.manual_seed(0)
logits, target = torch.randn(2, 3, 5, requires_grad=True), torch.softmax(torch.randn(2, 3, 5), -1)
mask = torch.tensor([[1, 0, 1], [0, 0, 1]]).view(2, 3, 1)
loss = specforge_run.torch_log_softmax_loss().LogSoftmaxLoss.apply(logits, target, mask)
rows = [-(target[b, t] * torch.log_softmax(logits[b, t], -1)).sum() for b in range(2) for t in range(3) if mask[b, t]]
assert torch.allclose(loss, sum(rows) / 6), (loss, sum(rows) / 6)
loss.backward()
assert logits.grad[0, 1].abs().sum() == 0
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO / "bench" / "peers", capture_output=True, text=True
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def peer_or_skip(peer: str) -> Path:
    python = PEERS_ROOT / peer / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no {peer} venv at {python.parent.parent} (bash scripts/install_peers.sh {peer})")
    return python


def run_in_peer(peer: str, code: str) -> str:
    done = subprocess.run([str(peer_or_skip(peer)), "-W", "ignore", "-c", code], cwd=REPO / "bench" / "peers",
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.engine
def test_specforge_reads_its_layout(tmp_path):
    write_layouts(tmp_path)
    code = f"""
from specforge.data.preprocessing import OfflineEagle3Dataset
from specforge.runtime.data_plane.feature_store import load_feature_file
from specforge.runtime.data_plane.offline_reader import list_feature_files
files = list_feature_files("{tmp_path / "specforge" / "train"}")
assert len(files) == 2, files
row = OfflineEagle3Dataset.process_data(load_feature_file(files[0]), max_len=512)
assert row["hidden_state"].shape == (1, 5, {3 * H}) and row["target"].shape == (1, 5, {H}), row["hidden_state"].shape
assert row["input_ids"].tolist() == [[3, 4, 5, 6, 7]] and row["loss_mask"].tolist() == [[0, 1, 1, 1, 0]]
print("ok")
"""
    assert "ok" in run_in_peer("specforge", code)


@pytest.mark.engine
def test_speculators_reads_its_layout(tmp_path):
    write_layouts(tmp_path)
    code = f"""
import torch
from speculators.train.data import ArrowDataset
split = {{"train": 2, "heldout": 1}}
ratio = (split["train"] + 0.5) / 3  # as bench/peers/speculators_run.py splits
train = ArrowDataset(512, "{tmp_path / "speculators"}", on_missing="raise", train_ratio=ratio)
val = ArrowDataset(512, "{tmp_path / "speculators"}", on_missing="raise", train_ratio=ratio, split="val")
assert len(train) == 2 and len(val) == 1
row = val[0]
assert row["input_ids"].tolist() == [3, 4, 8, 8] and row["loss_mask"].tolist() == [0, 1, 1, 1]
assert row["hidden_states"].shape == (4, {3 * H}) and row["verifier_last_hidden_states"].shape == (4, {H})
print("ok")
"""
    assert "ok" in run_in_peer("speculators", code)


@pytest.mark.engine
def test_modelopt_driver_batches_and_calibrates(tmp_path):
    write_layouts(tmp_path)
    code = f"""
import torch, modelopt_run
rows = modelopt_run.Conversations(__import__("pathlib").Path("{tmp_path / "data" / "train.jsonl"}"))
batch = modelopt_run.pad_to(6)([rows[0], rows[1]])
assert batch["input_ids"].tolist() == [[3, 4, 5, 6, 7, 0], [3, 9, 9, 0, 0, 0]]
assert batch["labels"][0].tolist() == [4, 5, 6, 7, -100, 0] and batch["loss_mask"][1].tolist() == [0, 0, 1, 0, 0, 0]
assert batch["attention_mask"][1].tolist() == [1, 1, 1, 0, 0, 0]
d2t = modelopt_run.calibrate({{"3": 3, "9": 2, "4": 1}}, 2)
assert d2t.tolist() == [3, 8]  # draft id i -> target id i + d2t[i]: 3, 9
print("ok")
"""
    assert "ok" in run_in_peer("modelopt", code)


def test_an_ablation_is_a_draftsmith_run_with_recipe_overrides(tmp_path):
    name, overrides = common.parse_ablation("lr:optim.lr=1e-4, trainer.batch_size=1")
    assert (name, overrides) == ("draftsmith-lr", ["optim.lr=1e-4", "trainer.batch_size=1"])
    cmd = training.train_command(name, tmp_path, {}, overrides)
    assert cmd[1].endswith("draftsmith_run.py") and cmd[0] == sys.executable
    assert cmd[-4:] == ["--override", "optim.lr=1e-4", "--override", "trainer.batch_size=1"]
    assert str(tmp_path / "runs" / "draftsmith-lr") in cmd
    for bad in ("lr", "lr:", ":optim.lr=1", "lr:optim.lr"):
        with pytest.raises(ValueError, match="NAME:KEY=VALUE"):
            common.parse_ablation(bad)


def test_draftsmiths_steps_see_the_budgets_rows_or_one_conversation_each():
    sys.path.insert(0, str(REPO / "bench" / "peers"))
    from draftsmith_run import online_steps

    budget = {"draftsmith_steps": 203, "batch_size": 4, "train": {"conversations": 1927}}
    assert online_steps(True, 4, budget) == 203  # the recipe: 812 packed rows, 4 a step
    assert online_steps(True, 1, budget) == 812  # the same rows, one a step
    assert online_steps(True, 3, budget) == 271  # a last, partial batch is a step
    assert online_steps(False, 1, budget) == 1927  # unpacked: a conversation a row, as many as the peers
    assert online_steps(False, 4, budget) == 482


def test_a_draftsmith_run_stopped_part_way_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """A long budget outlives a session: run again, draftsmith's side goes on from the last checkpoint in its
    folder instead of training from step 0 (and overwriting what the stopped run saved)."""
    sys.path.insert(0, str(REPO / "bench" / "peers"))
    import draftsmith_run

    calls = []
    monkeypatch.setattr(draftsmith_run, "train", lambda config, **kw: calls.append(kw) or "result")
    run = tmp_path / "run"
    assert draftsmith_run.train_or_resume("config", run, []) == ("result", None)
    assert (calls[-1]["resume"], calls[-1]["overwrite"]) == (False, True)  # nothing saved yet: afresh
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"a whole checkpoint")  # an empty file is a cut write
    assert draftsmith_run.train_or_resume("config", run, []) == ("result", run / "checkpoints" / "last.ckpt")
    assert (calls[-1]["resume"], calls[-1]["overwrite"]) == (True, False)
    # a finished run asked to train again does not "resume" its own end
    assert draftsmith_run.train_or_resume("config", run, [], fresh=True) == ("result", None)
    assert (calls[-1]["resume"], calls[-1]["overwrite"]) == (False, True)


def test_a_setting_is_any_pipelines_run_with_its_own_overrides(tmp_path):
    name, overrides = common.parse_setting(
        "specforge-lr3e4:training.learning_rate=3e-4,training.batch_size=2"
    )
    assert (name, overrides) == ("specforge-lr3e4", ["training.learning_rate=3e-4", "training.batch_size=2"])
    cmd = training.train_command(name, tmp_path, {}, overrides)
    assert cmd[0] == str(common.peer_python("specforge")) and cmd[1].endswith("specforge_run.py")
    assert cmd[-4:] == ["--override", "training.learning_rate=3e-4", "--override", "training.batch_size=2"]
    assert str(tmp_path / "runs" / "specforge-lr3e4") in cmd
    assert common.parse_ablation("lr:optim.lr=1e-4") == common.parse_setting("draftsmith-lr:optim.lr=1e-4")
    for bad in ("sglang-x:lr=1", "specforge:training.learning_rate=1", "specforge-x", "speculators-x:lr"):
        with pytest.raises(ValueError, match="PIPELINE-NAME:KEY=VALUE"):
            common.parse_setting(bad)


def test_a_sweep_keeps_its_finished_runs_and_trains_the_rest(tmp_path, monkeypatch):
    """A sweep stopped half way goes on where it stopped: a run the record holds as finished (exit 0, its head
    still there) is not trained again unless asked; a failed one, or one whose head is gone, is."""
    trained, commands = [], []

    def fake_run(cmd, log, env):
        run = Path(cmd[cmd.index("--out") + 1]).name
        trained.append(run)
        commands.append(cmd)
        return {"returncode": 0, "wall_s": 1.0, "cpu_s": 1.0, "head": str(tmp_path)}

    monkeypatch.setattr(training, "run_timed", fake_run)
    budget = {"train": {"positions": 100, "loss_tokens": 50}}
    head = tmp_path / "head"
    head.mkdir()
    results = {
        "draftsmith-a": {"returncode": 0, "head": str(head)},
        "draftsmith-b": {"returncode": 1, "head": str(head)},
        "draftsmith-c": {"returncode": 0, "head": str(tmp_path / "gone")},
    }
    runs = {
        name: ["optim.lr=1e-4"] for name in ("draftsmith-a", "draftsmith-b", "draftsmith-c", "draftsmith-d")
    }
    training.stage_train(tmp_path, [], budget, results, ablations=runs)
    assert trained == ["draftsmith-b", "draftsmith-c", "draftsmith-d"]
    assert not any(
        "--fresh" in cmd for cmd in commands
    )  # stopped or failed part way: resumed where they stopped
    training.stage_train(tmp_path, [], budget, results, ablations={"draftsmith-a": []}, rerun=True)
    assert trained[-1] == "draftsmith-a" and "--fresh" in commands[-1]  # finished, trained again: from step 0


def test_a_judged_run_whose_head_is_gone_stands_and_a_retrained_one_keeps_its_earlier_record(
    tmp_path, monkeypatch
):
    """A sweep's record goes on from another machine's: a run judged there (its head gone with that work folder)
    is not trained again and its figures are not replaced; one named to train again (for a head to judge here)
    trains, its earlier records kept under 'earlier'."""
    trained = []

    def fake_run(cmd, log, env):
        trained.append(Path(cmd[cmd.index("--out") + 1]).name)
        return {"returncode": 0, "wall_s": 2.0, "cpu_s": 2.0, "head": str(tmp_path)}

    monkeypatch.setattr(training, "run_timed", fake_run)
    budget = {"train": {"positions": 100, "loss_tokens": 50}}
    gone = str(tmp_path / "gone")
    there = {"returncode": 0, "head": gone, "judge": {"tau": 1.7}, "wall_s": 9.0}
    results = {"draftsmith-a": dict(there), "draftsmith-b": dict(there),
               "draftsmith-c": {"returncode": 0, "head": gone}}  # fmt: skip
    runs = {name: [] for name in results}
    training.stage_train(tmp_path, [], budget, results, ablations=runs)
    assert trained == ["draftsmith-c"]  # judged ones stand; an unjudged one whose head is gone trains
    assert results["draftsmith-a"] == there
    training.stage_train(tmp_path, [], budget, results, ablations=runs, rerun={"draftsmith-b"})
    assert trained == ["draftsmith-c", "draftsmith-b"]
    assert results["draftsmith-b"]["wall_s"] == 2.0 and results["draftsmith-b"]["earlier"] == [there]
    training.stage_train(tmp_path, [], budget, results, ablations=runs, rerun={"draftsmith-b"})
    assert [r["wall_s"] for r in results["draftsmith-b"]["earlier"]] == [9.0, 2.0]
    assert "earlier" not in results["draftsmith-b"]["earlier"][1]


def test_a_head_exported_part_way_by_the_same_run_training_again_is_not_the_records_finished_head(tmp_path):
    """draftsmith exports its draft at every validation, so the record's run training again in its own folder
    leaves a head there whose train_state.json says an earlier step: that run is not finished (the bench would
    skip it and the dev run judge a half-trained head), and a stopped retraining resumes instead of starting over."""
    head = tmp_path / "head"
    head.mkdir()
    record = {"returncode": 0, "head": str(head), "steps": 3250, "judge": {"tau": 2.6}}
    (head / "train_state.json").write_text(json.dumps({"step": 1700}))
    assert not training.finished(record) and training.standing(record)  # judged: it stands unless asked again
    (head / "train_state.json").write_text(json.dumps({"step": 3250}))
    assert training.finished(record)
    peer = tmp_path / "peer"  # a peer's head has no train_state.json: its folder is the head
    peer.mkdir()
    assert training.finished({"returncode": 0, "head": str(peer), "steps": 3250})


def test_a_run_trained_again_for_its_gone_head_resumes_its_checkpoint_and_a_finished_one_starts_over(
    tmp_path, monkeypatch
):
    """Training again a run whose head is there starts from step 0 (--fresh); training again a judged run whose
    head is gone (its work folder lost with a machine) does not, so a session that stopped it part way is not
    thrown away by the next one, which goes on from its checkpoint."""
    commands = {}

    def fake_run(cmd, log, env):
        commands[Path(cmd[cmd.index("--out") + 1]).name] = cmd
        return {"returncode": 1, "wall_s": 1.0, "cpu_s": 1.0}  # stopped part way: the record stays as it was

    monkeypatch.setattr(training, "run_timed", fake_run)
    budget = {"train": {"positions": 100, "loss_tokens": 50}}
    head = tmp_path / "head"
    head.mkdir()
    results = {
        "draftsmith-gone": {"returncode": 0, "head": str(tmp_path / "gone"), "judge": {"tau": 1.7}},
        "draftsmith-there": {"returncode": 0, "head": str(head), "judge": {"tau": 1.7}},
    }
    runs = {name: [] for name in results}
    training.stage_train(tmp_path, [], budget, results, ablations=runs, rerun=True)
    assert "--fresh" not in commands["draftsmith-gone"]
    assert "--fresh" in commands["draftsmith-there"]


def test_each_run_of_a_sweep_is_judged_on_the_heldout_rows_once_right_after_it_trains(tmp_path, monkeypatch):
    """The sweep's judge (bench/heldout_tau.py on the quickstart's held-out rows, k 5) runs after each run that
    finished, its τ kept in the run's record; a kept run without a judgement is judged once, a failed one not."""
    calls = []
    head = tmp_path / "head"
    head.mkdir()

    def fake_run(cmd, log, env=None):
        calls.append(cmd)
        if Path(cmd[1]).name == "heldout_tau.py":
            assert cmd[cmd.index("--recipe") + 1] == "quickstart" and cmd[cmd.index("--k") + 1] == "5"
            walk = {"tau": 1.5, "per_position": [0.4], "steps": 9}
            report = {"drafts": {cmd[cmd.index("--draft") + 1]: {"walk": walk, "every_start": {"tau": 1.7}}}}
            Path(cmd[cmd.index("--out") + 1]).parent.mkdir(parents=True, exist_ok=True)
            Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps(report))
            return {"returncode": 0, "wall_s": 1.0, "log": str(log)}
        run = Path(cmd[cmd.index("--out") + 1]).name
        return {
            "returncode": 0 if run != "draftsmith-bad" else 1,
            "wall_s": 1.0,
            "cpu_s": 1.0,
            "head": str(head),
        }

    monkeypatch.setattr(training, "run_timed", fake_run)
    budget = {"train": {"positions": 100, "loss_tokens": 50}}
    results = {"draftsmith-kept": {"returncode": 0, "head": str(head)}}
    runs = {"draftsmith-new": ["optim.lr=1e-4"], "draftsmith-bad": ["optim.lr=1e-4"]}
    training.stage_train(tmp_path, [], budget, results, ablations=runs, judge=True)
    assert results["draftsmith-new"]["judge"]["tau"] == 1.5
    assert "judge" not in results["draftsmith-bad"] and "judge" not in results["draftsmith-kept"]
    training.judge_missing(tmp_path, results)
    training.judge_missing(tmp_path, results)
    judged = [Path(c[c.index("--out") + 1]).stem for c in calls if Path(c[1]).name == "heldout_tau.py"]
    assert judged == ["draftsmith-new", "draftsmith-kept"]


@pytest.mark.engine
def test_each_peer_takes_its_own_settings_and_refuses_a_misspelt_one():
    """The words --setting passes reach each peer's own config, and a key the peer does not have stops the run
    (ModelOpt's load_recipe would take one silently: its driver checks)."""
    specforge = """
from driver import set_dotted
from specforge.config.schema import Config
run = {"model": {"target_model_path": "t"}, "data": {"hidden_states_path": "h"}, "training": {}, "output_dir": "o"}
set_dotted(run, "training.learning_rate", "3e-4"); set_dotted(run, "training.batch_size", "2")
cfg = Config.model_validate(run)
assert cfg.training.learning_rate == 3e-4 and cfg.training.batch_size == 2
set_dotted(run, "training.learning_rat", "3e-4")
try:
    Config.model_validate(run)
except Exception as e:
    print("refused", type(e).__name__)
"""
    assert "refused" in run_in_peer("specforge", specforge)
    speculators = """
import sys
from speculators.train.config import TrainConfig
sys.argv = ["x", "--verifier-name-or-path", "t", "--data-path", "d", "--lr", "3e-4", "--scheduler-warmup-steps", "5"]
cfg = TrainConfig.resolve()
print(cfg.optimizer.lr, cfg.scheduler.scheduler_warmup_steps)
sys.argv.append("--lr-typo")
try:
    TrainConfig.resolve()
except SystemExit:
    print("refused")
"""
    assert run_in_peer("speculators", speculators).split()[-3:] == ["0.0003", "5", "refused"]
    modelopt = """
from pathlib import Path
import modelopt_recipes, modelopt_run
from modelopt.recipe import load_recipe
base = load_recipe(str(Path(modelopt_recipes.__file__).parent / "general" / "speculative_decoding" / "eagle3.yaml"))
modelopt_run.check_keys(base.model_dump(), ["training.learning_rate", "training.warmup_steps"])
try:
    modelopt_run.check_keys(base.model_dump(), ["training.learning_rat"])
except SystemExit as e:
    print("refused", e)
"""
    assert "refused --override training.learning_rat" in run_in_peer("modelopt", modelopt)


@pytest.mark.engine
def test_each_peer_takes_a_seed_in_its_own_words():
    """The seed key bench/peer_training.py gives each pipeline reaches the peer's config (ModelOpt's recipe has
    none: its driver takes ``seed`` for the draft's initialisation and the Trainer's data order)."""
    assert set(common.SEED_KEYS) == set(common.RUNS)
    specforge = """
from driver import set_dotted
from specforge.config.schema import Config
run = {"model": {"target_model_path": "t"}, "data": {"hidden_states_path": "h"}, "training": {}, "output_dir": "o"}
print(Config.model_validate(run).training.seed)
set_dotted(run, "training.seed", "2")
print(Config.model_validate(run).training.seed)
"""
    assert run_in_peer("specforge", specforge).split()[-2:] == [
        str(common.DEFAULT_SEEDS["specforge"]),
        "2",
    ]
    speculators = """
import sys
from speculators.train.config import TrainConfig
sys.argv = ["x", "--verifier-name-or-path", "t", "--data-path", "d"]
print(TrainConfig.resolve().flatten()["seed"])
sys.argv += ["--seed", "2"]
print(TrainConfig.resolve().flatten()["seed"])
"""
    assert run_in_peer("speculators", speculators).split()[-2:] == [
        str(common.DEFAULT_SEEDS["speculators"]),
        "2",
    ]
    modelopt = """
from pathlib import Path
import modelopt_recipes, modelopt_run
from modelopt.recipe import load_recipe
base = load_recipe(str(Path(modelopt_recipes.__file__).parent / "general" / "speculative_decoding" / "eagle3.yaml"))
seed, rest = modelopt_run.split_seed([("seed", "2"), ("training.learning_rate", "5e-4")])
assert rest == [("training.learning_rate", "5e-4")]
training = {**base.training.model_dump(), "use_cpu": True, "tf32": False, "output_dir": "o"}  # as the driver runs it
print(modelopt_run.training_arguments(training, None).seed, modelopt_run.training_arguments(training, seed).seed)
"""
    assert run_in_peer("modelopt", modelopt).split()[-2:] == ["42", "2"]


@pytest.mark.engine
def test_specforge_reads_its_dflash_layout(tmp_path):
    """--draft dflash: SpecForge's DFlash record (the tapped states as ``hidden_states``), read by its own reader and
    normalizer; the bench passes the draft kind to every driver."""
    train, heldout = [{"input_ids": [3, 4, 5, 6, 7], "loss_mask": [0, 1, 1, 1, 1]}], []
    peer_inputs.write_peer_features(train, heldout, lambda ids: fake_capture(len(ids)), tmp_path / "specforge",
                                    tmp_path / "speculators", {4: 1}, draft="dflash")  # fmt: skip
    back = torch.load(tmp_path / "specforge" / "train" / "data_000000.ckpt", weights_only=True)
    assert set(back) == {"input_ids", "loss_mask", "hidden_states"}
    assert back["hidden_states"].shape == (1, 5, 3 * H)
    code = f"""
from specforge.algorithms.common.dflash_family_data import normalize_offline_sample
from specforge.runtime.data_plane.feature_store import load_feature_file
from specforge.runtime.data_plane.offline_reader import list_feature_files
files = list_feature_files("{tmp_path / "specforge" / "train"}")
row = normalize_offline_sample(load_feature_file(files[0]), max_len=512)
assert row["hidden_states"].shape == (1, 5, {3 * H}) and row["input_ids"].tolist() == [[3, 4, 5, 6, 7]]
print("ok")
"""
    assert "ok" in run_in_peer("specforge", code)
    cmd = training.train_command("specforge", tmp_path, {"draft": "dflash"})
    assert cmd[-2:] == ["--draft", "dflash"] and cmd[1].endswith("specforge_run.py")


def test_the_stand_in_capture_is_what_draftsmith_trains_on():
    """The capture the peers train on (``peer_inputs.capture``) against draftsmith's own teacher on a tiny
    target: the tapped layers' outputs at the same positions, and the last layer's output in both conventions
    the peers read it in: before the final norm (draftsmith's; speculators' ``verifier_last_hidden_states``,
    which its trainers put through ``verifier_norm`` and then the LM head) and after it (transformers' last
    hidden state; SpecForge's ``hidden_state``, which its trainer puts through the LM head alone). Either way
    the peer scores with the target's own logits, the ones draftsmith's teacher keeps the top-k of."""
    from tiny import tiny_target

    from draftsmith.train.objective import Batch
    from draftsmith.train.teacher import compute_teacher

    target = tiny_target("llama", layers=6)
    ids = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(0))
    layers = [1, 2, 4]
    aux, last, normed = peer_inputs.capture(target.model, ids[0].tolist(), layers)
    teacher = compute_teacher(target, Batch(ids, torch.ones_like(ids), torch.ones_like(ids)), [*layers, 5], 4)
    torch.testing.assert_close(aux, torch.cat([teacher.features[i][0] for i in layers], -1), rtol=0, atol=0)
    torch.testing.assert_close(last, teacher.features[5][0], rtol=0, atol=0)
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(normed, out.hidden_states[-1][0], rtol=0, atol=0)
    torch.testing.assert_close(normed, target.model.model.norm(last), rtol=0, atol=0)
    logits = target.model.lm_head(normed).float()  # what the peers score their targets with
    torch.testing.assert_close(logits.topk(4).values, teacher.topk_logits[0], rtol=1e-6, atol=1e-6)


def test_a_runs_seed_is_its_own_seed_override_in_any_pipelines_words():
    assert common.run_seed(["training.seed=2", "training.learning_rate=1e-3"]) == 2
    assert common.run_seed(["seed=1"]) == 1 and common.run_seed(["trainer.seed=3"]) == 3
    assert common.run_seed(["optim.lr=1e-4"]) == common.quickstart_seed()
    assert common.run_seed([], "specforge") == 42 and common.run_seed(["seed=2"], "modelopt") == 2


def test_a_runs_provenance_is_taken_as_it_starts(tmp_path, monkeypatch):
    """A sweep run trains for up to an hour while the tree may move on: its record names the commit it started
    from, not the one checked out when it ended."""
    from benchlib import records as report

    head = {"commit": "a"}
    monkeypatch.setattr(report, "provenance", lambda seed=None: {"commit": head["commit"], "seed": seed})

    def fake_run(cmd, log, env=None):
        head["commit"] = "b"  # a commit lands while the run trains
        return {"returncode": 0, "wall_s": 1.0, "cpu_s": 1.0, "head": str(tmp_path)}

    monkeypatch.setattr(training, "run_timed", fake_run)
    results = {}
    budget = {"train": {"positions": 100, "loss_tokens": 50}}
    # draftsmith's run: it needs no peer venv, so the test runs (and can fail) on a machine without them
    training.stage_train(tmp_path, [], budget, results, ablations={"draftsmith-x": ["trainer.seed=3"]})
    assert results["draftsmith-x"]["provenance"] == {"commit": "a", "seed": 3}


@pytest.mark.engine
def test_specforge_evaluates_once_at_its_last_step_whatever_its_batch():
    """Its held-out evaluation fires every eval_interval steps: with 4 conversations a step the last step is
    the 3rd of 10 conversations, not the 10th (the sweep's first batch-4 run logged no held-out metrics)."""
    code = """
import specforge_run
for batch, expected in ((None, 10), (4, 3), (1, 10)):
    run = {"training": {} if batch is None else {"batch_size": batch}}
    specforge_run.evaluate_once_at_the_end(run, 10)
    assert run["training"]["eval_interval"] == expected, run
print("ok")
"""
    assert "ok" in run_in_peer("specforge", code)


def test_the_eagle3_deciding_table_takes_a_larger_budget_per_point(tmp_path):
    """A larger budget's records (a seed each) become one summary row per point trained there, at that budget,
    with the records' own judge and the larger dev report's τ; a point not trained there has no row."""
    sys.path.insert(0, str(REPO / "bench"))
    from eagle3_recipe import KEEPER, larger_budget_rows

    def record(runs: dict) -> dict:
        return {"budget": {"tokens_asked": 1638400},
                "train": {n: {"judge": {"tau": t}} for n, t in runs.items()} | {"x-failed": {"judge": None}}}  # fmt: skip

    points = [{"pipeline": "draftsmith", "setting": ["optim.name=muon"], "runs": ["r0"], "default": True},
              {"pipeline": "speculators", "setting": ["total-seq-len=1024"], "runs": ["spec", "spec-seed1"]},
              {"pipeline": "specforge", "setting": ["lr=5e-4"], "runs": ["sf"]}]  # fmt: skip
    records = [(tmp_path / "a.json", record({KEEPER: 2.4, "spec-seed1": 2.1})),
               (tmp_path / "b.json", record({f"{KEEPER}-seed1": 2.5, "spec": 2.2, "spec-seed10": 2.0}))]  # fmt: skip
    rows = larger_budget_rows(records, points, {KEEPER: 1.5, "spec": 1.4})
    assert [(r["pipeline"], r["tokens"], r["default"]) for r in rows] == [
        ("draftsmith", 1638400, True),
        ("speculators", 1638400, False),
    ]
    assert rows[0]["runs"] == [KEEPER, f"{KEEPER}-seed1"] and rows[0]["heldout_tau"] == [2.4, 2.5]
    assert rows[0]["dev_tau"] == [1.5] and rows[0]["setting"] == ["optim.name=muon"]
    assert rows[1]["runs"] == ["spec", "spec-seed1", "spec-seed10"] and rows[1]["heldout_tau"] == [
        2.2,
        2.1,
        2.0,
    ]
    assert rows[1]["trained_in"] == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]


def test_the_larger_budgets_dev_tau_joins_reports_of_a_dev_run_split_over_sessions(tmp_path):
    """bench/eagle3_recipe.py --larger-dev REPORT ...: heads judged in separate dev runs (a machine's end split the
    run; greedy τ does not depend on what else ran) each take their τ from the report that holds them, and each
    report's judge is kept; one report alone leaves the other heads without a dev τ."""
    sys.path.insert(0, str(REPO / "bench"))
    import eagle3_recipe

    def report(heads: dict[str, float]) -> dict:
        settings = {"prompts": "builtin:dev_prompts", "num_prompts": 96, "order": "round-robin",
                    "max_new_tokens": 64, "k": 5}  # fmt: skip
        drafts = [{"name": f"runs/big/runs/{n}/run/draft", "tau": t, "exact_match": True, "speedup": 0.8}
                  for n, t in heads.items()]  # fmt: skip
        return {"settings": settings, "greedy": True, "hardware": {"cpu": "x"}, "drafts": drafts}

    keeper, spec = eagle3_recipe.KEEPER, "speculators-seq1024"
    machine = {"cpu": "AMD EPYC", "flags": ["avx2"]}
    judged = {"judge": {"tau": 2.0}, "provenance": {"commit": "c", "machine": machine, "date": "2026-12-07"}}
    paths = {name: tmp_path / f"{name}.json" for name in ("table", "peers", "big", "dev_a", "dev_b")}
    paths["table"].write_text(
        json.dumps(
            {"budget": {"tokens_asked": 409600}, "train": {keeper: judged, eagle3_recipe.BASE: judged}}
        )
    )
    peers = {"summary": {"speculators": {"setting": ["total-seq-len=1024"], "runs": [spec],
                                         "heldout_tau": {"values": [2.06]}}}}  # fmt: skip
    paths["peers"].write_text(json.dumps(peers))
    big = {n: judged for n in (keeper, f"{keeper}-seed1", spec)}
    paths["big"].write_text(json.dumps({"budget": {"tokens_asked": 1638400}, "train": big}))
    paths["dev_a"].write_text(json.dumps(report({keeper: 1.50, spec: 1.40})))
    paths["dev_b"].write_text(json.dumps(report({f"{keeper}-seed1": 1.52})))
    out = tmp_path / "out.json"
    common = ["--record", str(paths["table"]), "--peers", str(paths["peers"]), "--dev", str(tmp_path / "none.json"),
              "--larger", str(paths["big"]), "--ablations", "--out", str(out)]  # fmt: skip

    def larger_dev(*reports: str) -> tuple[dict, dict]:
        eagle3_recipe.main([*common, "--larger-dev", *(str(paths[r]) for r in reports)])
        result = json.loads(out.read_text())
        rows = {r["pipeline"]: r["dev_tau"] for r in result["summary"] if r["tokens"] == 1638400}
        return rows, result

    rows, result = larger_dev("dev_a", "dev_b")
    assert rows == {"draftsmith": [1.50, 1.52], "speculators": [1.40]}
    assert [j["report"] for j in result["larger_dev_judges"]] == [str(paths["dev_a"]), str(paths["dev_b"])]
    assert larger_dev("dev_a")[0] == {"draftsmith": [1.50], "speculators": [1.40]}


def run_bench_script(
    tmp_path: Path, script: str, env: dict, stages: dict[str, str] | None = None
) -> list[str]:
    """Run ``bench/<script>`` with a stand-in for python that runs the script's inline ``-c`` checks and records
    every other call instead of running it; ``stages`` maps a ``--stages`` name to the shell the stand-in runs
    for it (writing what that stage writes). Returns the recorded calls, one line each."""
    calls, fake = tmp_path / "calls.txt", tmp_path / "py"
    calls.unlink(missing_ok=True)
    cases = "".join(f'*"--stages {stage}"*) {shell};;\n' for stage, shell in (stages or {}).items())
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\necho "$@" >> {calls}\n'
        + (f'case "$*" in\n{cases}esac\n' if cases else "")
    )
    fake.chmod(0o755)
    env = dict(os.environ, PY=str(fake), **env)
    subprocess.run(["bash", str(REPO / "bench" / script)], env=env, check=True, cwd=REPO)
    return calls.read_text().splitlines() if calls.exists() else []


def test_the_larger_table_trains_again_a_judged_run_whose_head_is_gone_since_the_dev_run_needs_it(tmp_path):
    """bench/eagle3_larger.sh: a run the record judged but whose head went with a machine's runs/ is trained again
    (``--rerun``) before the dev run, which reads every head; runs whose heads are there, or that are not recorded,
    are not asked to."""
    work, out, dev = tmp_path / "work", tmp_path / "record.json", tmp_path / "dev"
    (work / "data").mkdir(parents=True)
    (work / "data" / "budget.json").write_text("{}")
    dev.mkdir()
    (dev / "report.json").write_text("{}")
    kept = tmp_path / "kept_head"
    kept.mkdir()
    partial = (
        tmp_path / "partial_head"
    )  # the record's run training again in its folder: a part-trained export
    partial.mkdir()
    (partial / "train_state.json").write_text(json.dumps({"step": 1700}))
    out.write_text(json.dumps({"capture": {"done": True}, "train": {
        "draftsmith-r45norms": {"head": str(tmp_path / "gone"), "judge": {"tau": 2.6}},
        "draftsmith-r45norms-seed1": {"head": str(partial), "steps": 3250, "judge": {"tau": 2.6}},
        "speculators-seq1024": {"head": str(kept), "judge": {"tau": 2.5}},
    }}))  # fmt: skip
    env = dict(DRAFTSMITH="true", WORK=str(work), OUT=str(out), DEV=str(dev), DEV_RESULT=os.devnull,
               DEV_PREFIX=str(tmp_path / "dev_1600k"), STEPS="train dev")  # fmt: skip
    lines = run_bench_script(tmp_path, "eagle3_larger.sh", env)
    runs = {line.split("--setting ")[1].split(":")[0]: line for line in lines if "--setting" in line}
    assert set(runs) == {"draftsmith-r45norms", "speculators-seq1024", "draftsmith-r45norms-seed1",
                         "speculators-seq1024-seed1"}  # fmt: skip
    assert [run for run, line in runs.items() if "--rerun" in line] == [
        "draftsmith-r45norms",
        "draftsmith-r45norms-seed1",
    ]
    # an earlier session's dev report judged the gone head before its machine went: it is not trained again
    drafts = [{"name": f"{work}/runs/draftsmith-r45norms/run/draft", "tau": 1.5}]
    (tmp_path / "dev_1600k.json").write_text(json.dumps({"drafts": drafts}))
    lines = run_bench_script(tmp_path, "eagle3_larger.sh", env)
    assert [line.split("--setting ")[1].split(":")[0] for line in lines if "--rerun" in line] == [
        "draftsmith-r45norms-seed1"
    ]


def test_the_larger_dev_run_judges_only_heads_no_report_holds_into_a_report_of_its_own(tmp_path):
    """bench/eagle3_larger.sh: the dev run evaluates the record's heads that no earlier dev report judged, writes the
    next report beside them with the provenance the eval does not write, and the table reads every report; with
    every head judged no eval runs."""
    work, out, dev = tmp_path / "work", tmp_path / "record.json", tmp_path / "dev"
    dev.mkdir()
    (dev / "report.json").write_text("{}")
    heads = {
        name: str(work / "runs" / name / "head") for name in ("draftsmith-r45norms", "speculators-seq1024")
    }
    out.write_text(json.dumps({"train": {name: {"head": head} for name, head in heads.items()}}))
    first = tmp_path / "dev_1600k.json"
    first.write_text(json.dumps({"drafts": [{"name": heads["speculators-seq1024"], "tau": 1.4}]}))
    evals = tmp_path / "evals.txt"
    draftsmith = tmp_path / "draftsmith"
    draftsmith.write_text(f'#!/bin/sh\necho "$@" >> {evals}\n')
    draftsmith.chmod(0o755)
    env = dict(DRAFTSMITH=str(draftsmith), WORK=str(work), OUT=str(out), DEV=str(dev),
               DEV_PREFIX=str(tmp_path / "dev_1600k"), STEPS="dev table")  # fmt: skip
    lines = run_bench_script(tmp_path, "eagle3_larger.sh", env)
    (evaluated,) = evals.read_text().splitlines()
    assert (
        f"--draft {heads['draftsmith-r45norms']}" in evaluated
        and heads["speculators-seq1024"] not in evaluated
    )
    provenance = json.loads((tmp_path / "dev_1600k_2.json").read_text())["provenance"]
    assert provenance["commit"] and provenance["command"].startswith("draftsmith eval --target")
    (table,) = [line for line in lines if "eagle3_recipe.py" in line]
    assert f"--larger-dev {first} {tmp_path / 'dev_1600k_2.json'}" in table
    (tmp_path / "dev_1600k_2.json").write_text(
        json.dumps({"drafts": [{"name": heads["draftsmith-r45norms"]}]})
    )
    evals.unlink()
    run_bench_script(tmp_path, "eagle3_larger.sh", env)
    assert not evals.exists()


def test_the_larger_table_trains_draftsmiths_runs_before_the_capture_only_the_peers_read(tmp_path):
    """bench/eagle3_larger.sh: draftsmith's runs are online and need the data stage only, so they come first and
    the capture (hours on a CPU) runs once, right before the first peer run."""
    work, out = tmp_path / "work", tmp_path / "record.json"
    # the data stage writes the budget, the capture its record, as the bench's do
    lines = run_bench_script(tmp_path, "eagle3_larger.sh", dict(WORK=str(work), OUT=str(out), STEPS="train"), {
        "data": f"mkdir -p {work}/data; echo {{}} > {work}/data/budget.json",
        "capture": f"echo '{{\"capture\": {{\"positions\": 1}}}}' > {out}",
    })  # fmt: skip
    stages = [line.split("--setting ")[1].split(":")[0] if "--setting" in line else line.split("--stages ")[1].split()[0]
              for line in lines]  # fmt: skip
    assert stages == ["data", "draftsmith-r45norms", "draftsmith-r45norms-seed1", "capture", "speculators-seq1024",
                      "speculators-seq1024-seed1"]  # fmt: skip


def test_ablations_of_another_machine_are_compared_with_that_machines_own_run_of_the_default(tmp_path):
    """bench/eagle3_recipe.py --ablations: a record trained on another machine (float32 there, bf16-mixed in the
    table's) holds its own run of the default, and each of its ablations is set against that run, not against the
    table's default; such a record without a judged default is refused by name."""
    sys.path.insert(0, str(REPO / "bench"))
    import eagle3_recipe

    def run(tau, overrides=()):
        machine = {"cpu": "AMD EPYC", "flags": ["avx2"]}
        return {"judge": {"tau": tau}, "overrides": list(overrides),
                "provenance": {"commit": "c", "machine": machine, "date": "2026-12-07"}}  # fmt: skip

    table = {"budget": {"tokens_asked": 409600},
             "train": {eagle3_recipe.KEEPER: run(2.22), "draftsmith-r45base": run(1.96)}}  # fmt: skip
    other = {"budget": {"tokens_asked": 409600},
             "train": {eagle3_recipe.KEEPER: run(2.10), "draftsmith-r45dnoise": run(2.15)}}  # fmt: skip
    paths = {name: tmp_path / f"{name}.json" for name in ("table", "other", "peers")}
    paths["table"].write_text(json.dumps(table))
    paths["other"].write_text(json.dumps(other))
    paths["peers"].write_text(json.dumps({"summary": {}}))
    out = tmp_path / "out.json"
    common = ["--record", str(paths["table"]), "--peers", str(paths["peers"]), "--dev", str(tmp_path / "none.json"),
              "--larger", "--out", str(out)]  # fmt: skip
    eagle3_recipe.main([*common, "--ablations", str(paths["other"])])
    rows = {(r["run"], Path(r["record"]).name): r for r in json.loads(out.read_text())["ablations"]}
    noise = rows[("draftsmith-r45dnoise", "other.json")]
    assert noise["against"] == eagle3_recipe.KEEPER and noise["delta"] == pytest.approx(2.15 - 2.10)
    assert rows[(eagle3_recipe.KEEPER, "table.json")]["delta"] == pytest.approx(2.22 - 1.96)
    del other["train"][eagle3_recipe.KEEPER]
    paths["other"].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="no judged run of the default"):
        eagle3_recipe.main([*common, "--ablations", str(paths["other"])])


def test_the_ablation_script_trains_the_default_first_then_each_change_once_then_the_table(tmp_path):
    """bench/eagle3_ablations.sh: the data stage when missing, the machine's own run of the default before any
    ablation (every row is compared with it), each ablation as the default plus its change, then the table."""
    work, out = tmp_path / "work", tmp_path / "record.json"
    data = {
        "data": f"mkdir -p {work}/data; echo {{}} > {work}/data/budget.json"
    }  # what the data stage writes
    lines = run_bench_script(tmp_path, "eagle3_ablations.sh", dict(WORK=str(work), OUT=str(out)), data)
    assert "--stages data" in lines[0] and "eagle3_recipe.py --ablations" in lines[-1]
    settings = [line.split("--setting ")[1].split()[0] for line in lines if "--setting" in line]
    names = [s.split(":")[0] for s in settings]
    assert names[0] == "draftsmith-r45norms" and len(set(names)) == len(names) >= 6
    default = set(settings[0].split(":")[1].split(","))
    for setting in settings[1:]:
        changed = set(setting.split(":")[1].split(",")) ^ default
        assert 1 <= len(changed) <= 6, (
            setting
        )  # the default plus one change (one option or one optimizer split)


def test_the_dflash_peer_script_captures_where_its_files_are_gone_then_trains_points_then_seeds(tmp_path):
    """bench/dflash_peers.sh: the data stage when missing; the capture when its files are not all here, though the
    record holds another machine's capture; each peer's new point in its own words; then the seeds of the pipelines
    named, by bench/peer_sweep.py, into a file beside the record; a second run captures nothing again."""
    work, out = tmp_path / "work", tmp_path / "record.json"
    # the record holds another machine's capture, whose files went with that machine
    out.write_text(json.dumps({"capture": {"positions": 1}}))
    stages = {  # the data stage writes the budget, the capture speculators' split.json last
        "data": f"mkdir -p {work}/data; echo {{}} > {work}/data/budget.json",
        "capture": f"mkdir -p {work}/speculators; echo {{}} > {work}/speculators/split.json",
    }
    env = dict(WORK=str(work), OUT=str(out))
    lines = run_bench_script(tmp_path, "dflash_peers.sh", env, stages)
    assert all("--draft dflash" in line for line in lines[:4])
    assert ["--stages data" in lines[0], "--stages capture" in lines[1]] == [True, True]
    points = [line.split("--setting ")[1].split()[0] for line in lines if "--setting" in line]
    assert [p.split("-")[0] for p in points] == ["speculators", "specforge"]
    assert points == ["speculators-t512:total-seq-len=512", "specforge-lr1e3:training.learning_rate=1e-3"]
    assert "peer_sweep.py" in lines[-1] and "--pipelines speculators specforge" in lines[-1]
    assert f"--out {tmp_path / 'record_seeds.json'}" in lines[-1] and f"--record {out}" in lines[-1]
    env |= dict(PIPELINES="specforge", STEPS="seeds")
    (line,) = run_bench_script(
        tmp_path, "dflash_peers.sh", env, stages
    )  # no data, no capture, no points: seeds
    assert "peer_sweep.py" in line and line.rstrip().split("--pipelines ")[1].split()[0] == "specforge"


def test_the_block_table_sets_vllms_acceptance_beside_draftsmiths_tau_from_the_run_that_served_the_draft():
    """bench/block_recipe.py's dev rows: a draft's row comes from the first report that holds it; where that run
    also served the draft with vLLM, vLLM's batch-1 acceptance length, by position, and its outputs' equality
    sit beside draftsmith's figures; a --no-vllm run gives none (not another run's)."""
    sys.path.insert(0, str(REPO / "bench"))
    import block_recipe

    served = {"batch_1": {"tau": 1.266, "per_position": [0.24, 0.09]}, "exact_match": True}
    with_vllm = {"draftsmith": {"dflash:a": {"tau": 1.263, "tau_drafting": 1.265}, "dflash:b": {"tau": 1.3}},
                 "vllm": {"dflash:a": served, "alone": {"batch_1": {"tau": 1.0}}}}  # fmt: skip
    without = {"draftsmith": {"dflash:a": {"tau": 9.0}, "dflash:c": {"tau": 1.2}}}
    rows = block_recipe.dev_rows({Path("first.json"): with_vllm, Path("second.json"): without})
    assert (
        rows["a"]["tau"] == 1.263 and rows["a"]["vllm_tau"] == 1.266 and rows["a"]["report"] == "first.json"
    )
    assert rows["a"]["vllm_per_position"] == [0.24, 0.09] and rows["a"]["vllm_exact_match"] is True
    assert (
        "vllm_tau" not in rows["b"] and "vllm_tau" not in rows["c"] and rows["c"]["report"] == "second.json"
    )
