"""The GPU-truth script's CPU rehearsal runs end to end, so the lent GPU's minutes go to measuring.

``bench/gpu_truth.py --rehearse`` is the device script itself on a tiny random target (the bundled
target's tokenizer and chat template) with a few prompts: data synthesis and continuous-batching
regeneration, training fitted to a time budget, packing the head, and every decode comparison. The
figures mean nothing; that every stage runs, that every speculative output equals the target alone's
and that the head comes back through the same way as a GPU head does, is what this checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # one subprocess run of every stage, shared by the tests below


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("truth")
    run = subprocess.run(
        [sys.executable, "bench/gpu_truth.py", "--rehearse", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    return out, json.loads((out / "results.json").read_text()), run.stdout


def test_data_stage_regenerates_and_flags_cut_replies(rehearsal):
    _, results, _ = rehearsal
    regen = results["data"]["regenerate"]
    assert regen["written"] > 0 and regen["tokens"] > 0 and regen["tokens_per_s"] > 0
    assert results["data"]["synthesize"]["written"] > 0
    # the rehearsal target ends some replies and runs others into max_new_tokens: both paths are met
    assert 0 < regen["truncated_replies"] < regen["replies"]
    assert 0 < results["data"]["conversations_with_a_cut_reply"] <= regen["written"]


def test_train_stage_fits_steps_and_packs_the_head(rehearsal, tmp_path):
    out, results, _ = rehearsal
    train = results["train"]
    assert 1 <= train["steps"] <= 3 and "tau" in train["val"]
    parts = sorted(out.glob("head-*.safetensors"))
    assert parts and (out / "meta.tar").is_file()
    back = tmp_path / "parts"  # the way home, as for a GPU head: parts + meta.tar -> a head directory
    back.mkdir()
    for part in parts:
        (back / part.name).write_bytes(part.read_bytes())
    with tarfile.open(out / "meta.tar") as tar:
        assert "manifest.json" in tar.getnames() and "config.json" in tar.getnames()
        tar.extractall(back, filter="data")
    from benchlib.transport import unpack

    from draftsmith.decode.target import load_target
    from draftsmith.drafts import build_drafter

    target = load_target(str(out / "work" / "tiny-target"), device="cpu", dtype="float32")
    head = unpack(back, tmp_path / "draft", target)
    build_drafter(str(head), target)


def test_decode_stage_is_lossless_in_every_setting(rehearsal):
    _, results, _ = rehearsal
    decode = results["decode"]
    assert set(decode["settings"]) == {"eager", "static+graphs"}
    for setting, rows in decode["settings"].items():
        names = [d["name"] for d in rows["drafts"]]
        assert {"ngram", "eagle3", "eagle3 k=auto"} <= set(names), setting
        for d in rows["drafts"]:
            assert d["exact_match"] is True, (setting, d["name"])
            assert d["verify_ms_per_step"] > 0
    assert any(d["name"].startswith("eagle3 tree") for d in decode["settings"]["eager"]["drafts"])
    prompts = decode["prompts"]
    peers = decode["peers"]
    assert peers["draftsmith: eagle3"]["same_as_first"] == prompts
    assert {"hf: generate", "hf: prompt_lookup"} <= set(peers)
    assert peers["hf: generate"]["same_as_first"] == prompts  # float32 rehearsal: the same greedy tokens
    assert [r["method"] for r in decode["batched"]][:2] == ["target alone", "ngram"]
    assert all(r["exact"] == r["prompts"] for r in decode["batched"])
