"""``target.shard``: the frozen target sharded across 2 gloo ranks on the CPU (FSDP2). The teacher and the
training loss match an unsharded target's, each rank holds half the target, and the option is refused
where it cannot work, before anything is loaded or written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_distributed import logged_losses
from test_loop import QUIET, make_config, tiny_target_dir  # noqa: F401 (fixture)
from test_resume import run_worker, uniform_conversations  # noqa: F401 (fixture)

from draftsmith.train.loop import train
from draftsmith.train.schema import describe

TESTS = Path(__file__).resolve().parent
# Online EAGLE-3, the training the option exists for (its head copies the target's embedding and LM head
# before the target is sharded).
TWO_RANKS = ("--draft.kind=eagle3", "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.batch_size=2",
             "--trainer.max_steps=4", "--trainer.ckpt_every=2", "--trainer.val_every=2", "--optim.lr=0.05")  # fmt: skip


# gemma2: sandwich norms, soft-capping, and here tied embeddings
@pytest.mark.parametrize("arch, tied", [("qwen3", "untied"), ("gemma2", "tied")])
@pytest.mark.slow
def test_sharded_target_gives_the_same_teacher_and_holds_half(arch, tied, tmp_path):
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(TESTS / "shard_target_worker.py"), arch, tied, str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    total = ranks[0]["total"]
    assert sum(r["local"] for r in ranks) == total  # every weight held once, by one rank
    for r in ranks:
        assert r["sharded"] and r["same_ids"]
        assert r["feature_diff"] <= 1e-6 and r["logit_diff"] <= 1e-6, r
        assert 0.45 * total <= r["local"] <= 0.55 * total, r
        # float32 weights: the rank's storage is its half, not views of the whole
        assert r["stored_bytes"] <= 0.55 * total * 4, r


@pytest.fixture(scope="module")
def two_rank_runs(tiny_target_dir, uniform_conversations, tmp_path_factory):  # noqa: F811
    """The same 2-rank DDP run with the target sharded and with a whole copy on each rank."""
    runs = {}
    for shard in (True, False):
        out = tmp_path_factory.mktemp("shard") / f"shard_{shard}"
        proc = run_worker(
            tiny_target_dir, uniform_conversations, out, *TWO_RANKS, f"--target.shard={str(shard).lower()}",
            timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        runs[shard] = (out, proc.stdout + proc.stderr)
    return runs


@pytest.mark.slow
def test_sharded_target_trains_as_an_unsharded_one(two_rank_runs):
    (sharded, log), (whole, whole_log) = two_rank_runs[True], two_rank_runs[False]
    lines = re.findall(r"rank (\d): target sharded over 2 ranks, ([\d,]+) of its ([\d,]+) parameters", log)
    held = {int(r): int(n.replace(",", "")) for r, n, _ in lines}
    total = {int(t.replace(",", "")) for _, _, t in lines}
    assert sorted(held) == [0, 1] and {sum(held.values())} == total, log[-3000:]
    assert "target sharded" not in whole_log
    a, b = logged_losses(sharded), logged_losses(whole)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3] and b[3] < b[0]  # it learns: not two flat lines
    for step in b:
        assert a[step] == pytest.approx(b[step], rel=1e-6, abs=1e-7), (step, a, b)
    tau = [json.loads((out / "draft" / "train_state.json").read_text())["tau"] for out in (sharded, whole)]
    assert tau[0] == pytest.approx(tau[1], rel=1e-6)  # validation ran through the sharded target too


@pytest.mark.parametrize(
    "overrides, named",
    [
        ((), "2 or more processes"),
        (("--trainer.devices=2", "--trainer.strategy=ddp_spawn"), "trainer.strategy='ddp_spawn'"),
        (
            ("--trainer.devices=2", "--trainer.strategy=deepspeed_stage_3"),
            "trainer.strategy='deepspeed_stage_3'",
        ),
        (("--trainer.devices=2", "--trainer.strategy=fsdp"), "trainer.strategy='fsdp'"),
        (("--trainer.devices=2", "--trainer.strategy=ddp", "--mode=offline"), "mode: online"),
        (
            ("--trainer.devices=2", "--trainer.strategy=ddp", "--target.device_map=auto"),
            "target.device_map: auto",
        ),
    ],
)
def test_shard_refused_where_it_cannot_work(
    overrides,
    named,
    tiny_target_dir,  # noqa: F811
    uniform_conversations,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    refuse = lambda *a, **k: pytest.fail("loaded the target first")  # noqa: E731
    monkeypatch.setattr("draftsmith.train.loop.load_target", refuse)
    out = tmp_path / "run"
    config = make_config(tiny_target_dir, uniform_conversations, out, "--target.shard=true", *overrides)
    with pytest.raises(ValueError, match=re.escape(named)) as err:
        train(config, **QUIET)
    assert "target.shard" in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()  # nothing written


def test_cli_refuses_shard_in_one_process(capsys, tmp_path):
    from draftsmith.cli import main

    recipe = TESTS.parent / "configs" / "debug_eagle3.yaml"
    code = main(["train", str(recipe), "--target.shard=true", f"--output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "target.shard needs 2 or more processes" in err and "trainer.devices" in err
    assert not (tmp_path / "run").exists()


def test_shard_is_in_train_help():
    assert re.search(r"target\.shard  \(bool, default False\)\n\s+Shard the frozen target", describe())


def test_a_run_from_before_target_shard_resumes(tiny_target_dir, uniform_conversations, tmp_path):  # noqa: F811
    """Sharding is where the target runs, not what the run computes: a resume may switch it, and a run whose
    config.yaml predates the key (written without it) resumes without --force-resume."""
    out = tmp_path / "run"
    steps = ("--trainer.max_steps=2", "--trainer.val_every=100", "--trainer.ckpt_every=1")
    train(make_config(tiny_target_dir, uniform_conversations, out, *steps), **QUIET)
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["target"].pop("shard") is False
    (out / "config.yaml").write_text(yaml.safe_dump(recorded, sort_keys=False))
    longer = make_config(tiny_target_dir, uniform_conversations, out, *steps, "--trainer.max_steps=3")
    assert train(longer, resume=True, **QUIET).steps == 3
