"""Faults a user meets at the ends of the path, tried through the real entry points: an export onto a mount
point or a read-only place, an export folder shared with the user's own files, a folder that is no draft
given to publish or eval, a too-long warm-up prompt with --truncate-prompts, and what the first screen
and a log file show."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
from test_export import eagle_dir, target  # noqa: F401 (fixtures)
from test_files import busy_mount, entries
from test_loop import tiny_target_dir  # noqa: F401 (fixture)
from test_new_user import eval_argv, long_prompts  # noqa: F401 (fixture)

from draftsmith import files
from draftsmith.cli import main


def export_argv(draft, out, *extra):
    return ["export", str(draft), "--to", "vllm", "--out", str(out), *extra]


def test_an_export_onto_a_mount_point_is_written_into_it_and_leaves_nothing_beside(
    eagle_dir, tmp_path, monkeypatch
):
    volume = tmp_path / "volume"
    volume.mkdir()
    busy_mount(monkeypatch, volume)  # renaming it fails with EBUSY, as a container volume does
    assert main(export_argv(eagle_dir, volume)) == 0
    assert main(["export", str(volume), "--to", "vllm", "--verify"]) == 0
    (volume / "notes.txt").write_text("mine")
    assert main(export_argv(eagle_dir, volume, "--overwrite")) == 0
    assert entries(tmp_path) == ["volume", "volume/.draftsmith-files", "volume/config.json",
                                 "volume/model.safetensors", "volume/notes.txt"]  # fmt: skip


def read_only(monkeypatch, folder):
    """``folder`` read-only: mode 0555, and, since root (as the tests may run) ignores mode bits, every
    temporary file or folder made in it fails with EROFS as on a read-only file system (simulated)."""
    os.chmod(folder, 0o555)
    real_stemp, real_dtemp = files.tempfile.mkstemp, files.tempfile.mkdtemp

    def refuse(real):
        def make(*a, dir=None, **k):
            if dir is not None and os.path.abspath(dir).startswith(os.path.abspath(folder)):
                raise OSError(errno.EROFS, "Read-only file system", str(dir))
            return real(*a, dir=dir, **k)

        return make

    monkeypatch.setattr(files.tempfile, "mkstemp", refuse(real_stemp))
    monkeypatch.setattr(files.tempfile, "mkdtemp", refuse(real_dtemp))


def test_an_export_into_a_read_only_place_is_one_line_before_anything_is_written(
    eagle_dir, tmp_path, monkeypatch, capsys
):
    place = tmp_path / "ro"
    place.mkdir()
    read_only(monkeypatch, place)
    try:
        for out in (place, place / "new"):
            assert main(export_argv(eagle_dir, out)) == 2
            err = capsys.readouterr().err
            assert f"{out} cannot be written" in err and "Pass a folder you can write to" in err
            assert len(err.strip().splitlines()) == 1
    finally:
        os.chmod(place, 0o755)
    assert entries(tmp_path) == ["ro"]


def test_a_file_system_failing_midway_is_one_line_and_leaves_nothing(
    eagle_dir, tmp_path, monkeypatch, capsys
):
    def read_only_now(src, dst, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(dst))

    monkeypatch.setattr(files.os, "replace", read_only_now)  # the check passed; the file system then turned
    assert main(export_argv(eagle_dir, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "could not write the export to" in err and "Read-only file system" in err
    assert len(err.strip().splitlines()) == 1
    assert entries(tmp_path) == []


def not_a_draft(folder):
    """A folder that looks like a draft at a glance: a config.json (``{"foo": 1}``) and safetensors weights."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"foo": 1}')
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    return folder


def test_publish_refuses_a_folder_that_is_no_draft_naming_what_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token_0123456789")
    folder = not_a_draft(tmp_path / "thing")
    argv = ["publish", str(folder), "--repo-id", "me/thing", "--base-model", "org/target", "--license", "mit",
            "--dry-run", "--no-eval", "--out", str(tmp_path / "pub")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{folder} is not a draft draftsmith trained" in err and "names no draftsmith_kind" in err
    assert not (tmp_path / "pub").exists()


def test_eval_refuses_a_folder_that_is_no_draft_before_the_target_loads(tmp_path, monkeypatch, capsys):
    from test_new_user import no_target_load

    no_target_load(monkeypatch, "draftsmith.decode.target")
    folder = not_a_draft(tmp_path / "thing")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    argv = ["eval", "--target", "smollm2-135m-instruct", "--draft", str(folder), "--prompts", str(prompts),
            "--out", str(tmp_path / "eval")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--draft {folder} is not a draft" in err and "no model_type" in err
    assert not (tmp_path / "eval").exists()


def test_truncate_prompts_holds_for_a_too_long_prompt_among_the_warm_up_ones(
    tiny_target_dir, long_prompts, tmp_path
):
    """The long prompt comes first, so the warm-up (1 prompt) meets it before the timed run does."""
    argv = eval_argv(tiny_target_dir, long_prompts, tmp_path / "out", "--truncate-prompts")
    argv[argv.index("--warmup") + 1] = "1"
    assert main(argv) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["truncated_generations"] == 1 and report["settings"]["warmup"] == 1


def cli_to_a_pipe(*argv: str) -> str:
    """``draftsmith ARGV`` in a subprocess with stdout and stderr sent to a pipe, as to a SLURM log file."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli", *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


THIRD_PARTY_NOISE = ("litlogger", "Tip:", "LeafSpec", "is_gradient_checkpointing", "FutureWarning")


@pytest.mark.slow
def test_the_first_screen_of_training_shows_no_third_party_tips_or_deprecations(tiny_target_dir, tmp_path):
    data = tmp_path / "convs.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"count from {i}"},
                               {"from": "gpt", "value": f"{i} {i + 1} {i + 2}"}]} for i in range(12)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = cli_to_a_pipe("train", "configs/debug_eagle3.yaml", f"--target.spec={tiny_target_dir}",
                        f"--data.paths=[{data}]", "--data.limit=null", "--draft.options.draft_vocab_size=200",
                        "--trainer.max_steps=1", "--trainer.val_every=1", "--trainer.ckpt_every=1",
                        f"--output.dir={tmp_path / 'run'}")  # fmt: skip
    assert "[draftsmith] trained 1 steps" in out
    assert [word for word in THIRD_PARTY_NOISE if word in out] == []


def test_a_third_party_deprecation_is_filtered_only_in_the_command_line_and_draftsmiths_own_never():
    import warnings

    from draftsmith.cli import quiet_third_parties

    def warn(module: str, message: str, category=FutureWarning):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_third_parties()
            warnings.warn_explicit(message, category, "x.py", 1, module=module)
        return [str(w.message) for w in caught]

    assert (
        warn("transformers.modeling_utils", "`is_gradient_checkpointing` is deprecated and will be removed")
        == []
    )
    assert warn("lightning.pytorch.utilities._pytree", "`isinstance(treespec, LeafSpec)` is deprecated") == []
    assert (
        warn("draftsmith.drafts.distill", "`is_gradient_checkpointing` is deprecated") != []
    )  # draftsmith's own
    assert warn("transformers.generation", "another deprecation") != []  # only the ones named


def test_eval_in_a_log_file_reports_progress_now_and_then(tiny_target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count from {i}"}) + "\n" for i in range(3)))
    out = cli_to_a_pipe("eval", "--target", str(tiny_target_dir), "--draft", "ngram", "--prompts", str(prompts),
                        "--limit", "2", "--max-new-tokens", "8", "--out", str(tmp_path / "eval"))  # fmt: skip
    lines = [line for line in out.splitlines() if line.startswith("eval  ")]
    assert [line.split("  ")[1] for line in lines] == ["1/2 prompts", "2/2 prompts"], out
    assert all("tok/s: target alone" in line and "ngram" in line and "(τ " in line for line in lines)
    assert "eval:" not in out  # no tqdm bar ("eval:  50%|...") redrawn into the file
