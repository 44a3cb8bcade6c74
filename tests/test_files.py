"""``draftsmith.files``: atomic writes that land readable by everyone (an engine may run as another user)."""

from __future__ import annotations

import json
import os
import stat

import pytest
from safetensors.torch import save_file

from draftsmith import files
from draftsmith.train.checkpoint import export_draft


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def private_umask():
    """A umask that makes every new file owner-only, as on locked-down machines."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def test_files_and_directories_land_with_the_shared_modes(tmp_path, private_umask):
    import torch

    files.write_text(tmp_path / "a.txt", "x")
    files.write_with(tmp_path / "w.safetensors", lambda p: save_file({"w": torch.zeros(2)}, str(p)))
    files.copy_file(tmp_path / "a.txt", tmp_path / "b.txt")

    def fill(d):
        (d / "sub").mkdir()
        (d / "sub" / "c.txt").write_text("c")
        save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))

    files.replace_dir(tmp_path / "dir", fill)
    for name in ("a.txt", "w.safetensors", "b.txt", "dir/sub/c.txt", "dir/model.safetensors"):
        assert mode(tmp_path / name) == files.FILE_MODE, name
    for name in ("dir", "dir/sub"):
        assert mode(tmp_path / name) == files.DIR_MODE, name


def test_a_trained_runs_draft_directory_is_readable_by_everyone(tmp_path, private_umask):
    class Objective:
        def save(self, draft, directory):
            save_file({"w": draft}, str(directory / "model.safetensors"))

    import torch

    out = export_draft(Objective(), torch.zeros(2), tmp_path / "draft", {"train_state.json": "{}"})
    assert mode(out) == files.DIR_MODE
    assert {mode(p) for p in out.iterdir()} == {files.FILE_MODE}


def test_a_failed_write_leaves_the_old_file_and_nothing_else(tmp_path):
    files.write_text(tmp_path / "a.txt", "old")

    def dies(path):
        path.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.write_with(tmp_path / "a.txt", dies)
    assert (tmp_path / "a.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_stale_temporaries_of_killed_writes_are_found_and_removed(tmp_path):
    (tmp_path / ".draft.tmp-abc").mkdir()
    (tmp_path / ".draft.old-xyz").mkdir()
    (tmp_path / ".draft.tmp-file").write_text("x")
    (tmp_path / "draft").mkdir()
    (tmp_path / ".other.tmp-1").mkdir()
    removed = files.remove_stale(tmp_path, "draft")
    assert sorted(p.name for p in removed) == [".draft.old-xyz", ".draft.tmp-abc", ".draft.tmp-file"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-1", "draft"]


def test_a_safetensors_file_cut_anywhere_or_padded_is_told_apart_from_a_whole_one(tmp_path):
    import torch
    from safetensors import safe_open

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.arange(6.0), "b": torch.ones(2, 3)}, str(path))
    whole = path.read_bytes()
    assert files.safetensors_problem(path) is None
    for size in (0, 5, 8, 40, len(whole) - 1):  # in the length, the header, the tensors
        path.write_bytes(whole[:size])
        assert files.safetensors_problem(path).startswith("cut short"), size
        with pytest.raises(Exception, match="header"):  # the library's own error, naming no file
            safe_open(str(path), framework="pt")
    path.write_bytes(whole + b"\0\0")
    assert files.safetensors_problem(path).startswith("corrupt")
    path.write_bytes(b"\xff" * 64)
    assert files.safetensors_problem(path).startswith("not a safetensors file")


def test_malformed_json_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{\n  "hidden_size": 32,\n}\n')
    with pytest.raises(ValueError) as err:
        files.read_json(path, "Save the draft again")
    first, snippet, caret = str(err.value).splitlines()
    assert first == (
        f"{path} is not valid JSON: Expecting property name enclosed in double quotes at line 3, column 1. "
        "Save the draft again."
    )
    assert snippet.strip() == "}" and caret.strip() == "^"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON list where an object belongs"):
        files.read_json(path)
    assert files.read_json(path, expect_object=False) == [1, 2]


def test_a_model_folder_with_a_missing_shard_or_cut_file_is_refused(tmp_path):
    import torch

    save_file({"a": torch.zeros(4)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors. Fetch it"):
        files.check_model_files(tmp_path, "Fetch it again")
    save_file({"b": torch.zeros(4)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert files.check_model_files(tmp_path, "Fetch it again") == tmp_path
    shard = tmp_path / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 4)
    with pytest.raises(ValueError, match=r"model-00002-of-00002.safetensors is cut short: \d+ bytes of the"):
        files.check_model_files(tmp_path, "Fetch it again")


def test_a_checkpoint_cut_short_anywhere_is_refused_by_name(tmp_path):
    import torch

    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.arange(4000.0)}, "global_step": 3}, path)
    whole = path.read_bytes()
    assert files.checkpoint_problem(path) is None and files.check_checkpoint(path, "Resume anew") == path
    for size in (0, 100, len(whole) // 2, len(whole) - 30):
        path.write_bytes(whole[:size])
        with pytest.raises(Exception) as raw:
            torch.load(path, weights_only=True)
        assert str(path) not in str(raw.value)  # torch's own error does not say which file
        with pytest.raises(ValueError, match=f"{path} is cut short or corrupt: .* Resume anew."):
            files.check_checkpoint(path, "Resume anew")
