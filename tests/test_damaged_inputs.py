"""Damaged inputs: a cut-short safetensors file, a malformed config.json, a cut-short target. Every command
that reads one (eval, export, publish) says in one line which file and what is wrong, exits 2, and
writes nothing from it (a copy cut short by a killed ``cp`` or download is what a cluster leaves)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_model, tiny_target, tiny_tokenizer

from draftsmith.cli import main
from draftsmith.drafts.eagle import EagleConfig, EagleHead
from draftsmith.drafts.eagle_parts import build_vocab_map
from draftsmith.drafts.engines import export_engines

PROMPTS = [{"question_id": 1, "category": "chat", "turns": ["Tell me about cats."]}]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A run directory holding an EAGLE-3 head, the target it was trained for, and a prompt file."""
    root = tmp_path_factory.mktemp("work")
    target = tiny_target("llama", layers=8)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target, draft_vocab_size=120))
    head.set_vocab_map(*build_vocab_map(torch.rand(target.vocab_size), 120))
    head.init_from_target(target.model)
    head.save_pretrained(root / "run" / "draft")
    (root / "run" / "config.yaml").write_text("draft: {kind: eagle3}\n")
    tiny_model("llama", layers=8).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root


def cut(path, size: int) -> None:
    os.truncate(path, size)


def error_line(err: str) -> str:
    """The command's error line (a progress bar of a model that loaded may come before it)."""
    return next(line for line in err.splitlines() if line.startswith("draftsmith "))


DAMAGE = {
    # how -> (file damaged, relative to the run's draft/; damage; what the line must say)
    "header cut": ("model.safetensors", lambda p: cut(p, 100), "cut short: 100 bytes"),
    "tensors cut": ("model.safetensors", lambda p: cut(p, p.stat().st_size // 2), "cut short"),
    "bad json": (
        "config.json",
        lambda p: p.write_text(p.read_text().replace("{", "{,", 1)),
        "is not valid JSON: Expecting property name enclosed in double quotes at line 1, column 2",
    ),
}


def command(name: str, run, out) -> list[str]:
    if name == "eval":
        return ["eval", "--target", "target", "--draft", str(run), "--prompts", "prompts.jsonl",
                "--max-new-tokens", "4", "--k", "2", "--warmup", "0", "--out", str(out)]  # fmt: skip
    if name == "publish":
        return ["publish", str(run), "--repo-id", "me/x", "--base-model", "a/b", "--license", "mit",
                "--no-eval", "--dry-run", "--out", str(out)]  # fmt: skip
    return ["export", str(run), "--to", name.removeprefix("export-"), "--out", str(out)]


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("name", ["eval", "export-hf", "export-vllm", "export-speculators", "publish"])
def test_a_damaged_draft_is_one_line_naming_the_file_and_nothing_is_written(
    work, tmp_path, monkeypatch, capsys, how, name
):
    monkeypatch.chdir(work)
    run = tmp_path / "run"
    shutil.copytree(work / "run", run)
    file, damage, said = DAMAGE[how]
    damage(run / "draft" / file)
    out = tmp_path / "out"
    assert main(command(name, run, out)) == 2
    first = error_line(capsys.readouterr().err)
    assert first.startswith(f"draftsmith {name.split('-')[0]}: error: {run / 'draft' / file} ")
    assert said in first and "again" in first  # what is wrong, and what to do
    assert not out.exists() and not list(tmp_path.glob(".out*"))  # no export, no half of one


def poison(weights_file, name: str) -> None:
    """Two entries of the tensor ``name`` not finite (a NaN and a -inf), as a diverged training leaves them."""
    tensors = load_file(str(weights_file))
    flat = tensors[name].view(-1)
    flat[0], flat[1] = float("nan"), float("-inf")
    save_file(tensors, str(weights_file), metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["eval", *(f"export-{e.name}" for e in export_engines())])
def test_a_draft_with_a_non_finite_tensor_is_refused_naming_the_tensor_and_nothing_is_written(
    work, tmp_path, monkeypatch, capsys, name
):
    """Every exporter and eval refuse a draft whose training diverged, before any engine or decoder takes it."""
    monkeypatch.chdir(work)
    run = tmp_path / "run"
    shutil.copytree(work / "run", run)
    weights = run / "draft" / "model.safetensors"
    tensor = sorted(n for n, t in load_file(str(weights)).items() if t.is_floating_point())[0]
    poison(weights, tensor)
    out = tmp_path / "out"
    assert main(command(name, run, out)) == 2
    first = error_line(capsys.readouterr().err)
    assert first.startswith(
        f"draftsmith {name.split('-')[0]}: error: {weights} holds a tensor that is not finite: "
    )
    assert f"{tensor} has 2 inf or NaN entries" in first and "train it again" in first
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_cut_short_target_names_its_file_before_anything_runs(work, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(work)
    shutil.copytree(work / "target", tmp_path / "target")
    weights = tmp_path / "target" / "model.safetensors"
    cut(weights, weights.stat().st_size - 10)
    argv = command("eval", work / "run", tmp_path / "out")
    argv[argv.index("target")] = str(tmp_path / "target")
    assert main(argv) == 2
    first = error_line(capsys.readouterr().err)
    assert f"{weights} is cut short" in first and "again" in first
    assert not (tmp_path / "out").exists()
