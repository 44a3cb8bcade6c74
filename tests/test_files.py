"""``draftsmith.files``: atomic writes that land readable by everyone (an engine may run as another user)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from safetensors.torch import save_file

from draftsmith import files
from draftsmith.train.infra.checkpoint import export_draft


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


def busy_mount(monkeypatch, directory):
    """Make ``directory`` behave as a mount point (a container volume): renaming it, or onto it, fails with
    EBUSY as the kernel says for a mount point; renaming files inside it works. Simulated, as making a real
    mount needs privileges a test does not have."""
    import errno

    real = os.replace

    def replace(src, dst, *a, **k):
        if os.path.abspath(directory) in (os.path.abspath(src), os.path.abspath(dst)):
            raise OSError(errno.EBUSY, "Device or resource busy", str(dst))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(files.os, "replace", replace)


def entries(folder) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_a_folder_that_cannot_be_renamed_is_filled_in_place_leaving_nothing_temporary(tmp_path, monkeypatch):
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "old.bin").write_text("an earlier write")
    busy_mount(monkeypatch, volume)

    def fill(d):
        (d / "model.safetensors").write_text("weights")
        (d / "sub").mkdir()
        (d / "sub" / "c.txt").write_text("c")

    files.replace_dir(volume, fill)
    assert entries(tmp_path) == ["volume", "volume/model.safetensors", "volume/sub", "volume/sub/c.txt"]
    assert mode(volume / "model.safetensors") == files.FILE_MODE


def test_a_write_into_a_mount_that_fails_midway_leaves_nothing_temporary(tmp_path, monkeypatch):
    import errno

    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "config.json").write_text("old")
    busy_mount(monkeypatch, volume)
    real = files.os.replace

    def full(src, dst, *a, **k):
        if str(dst).endswith("model.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(files.os, "replace", full)

    def fill(d):
        (d / "config.json").write_text("new")
        (d / "model.safetensors").write_text("weights")

    with pytest.raises(OSError, match="No space left"):
        files.replace_dir(volume, fill)
    assert entries(tmp_path) == ["volume", "volume/config.json"]


def test_a_failed_swap_leaves_the_old_folder_and_nothing_beside_it(tmp_path, monkeypatch):
    import errno

    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text("old")
    real = os.replace

    def fails_once_moved_aside(src, dst, *a, **k):
        if os.path.basename(src).startswith(".dir.tmp-"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(files.os, "replace", fails_once_moved_aside)
    with pytest.raises(OSError, match="Read-only"):
        files.replace_dir(tmp_path / "dir", lambda d: (d / "a.txt").write_text("new"))
    assert entries(tmp_path) == ["dir", "dir/a.txt"] and (tmp_path / "dir" / "a.txt").read_text() == "old"


@pytest.mark.parametrize("mounted", [False, True])
def test_rewriting_a_shared_folder_replaces_only_what_draftsmith_wrote(tmp_path, monkeypatch, mounted):
    out = tmp_path / "out"
    if mounted:
        out.mkdir()
        busy_mount(monkeypatch, out)
    files.replace_dir(out, lambda d: [(d / n).write_text("first") for n in ("config.json", "old.safetensors")],
                      keep_others=True)  # fmt: skip
    (out / "notes.txt").write_text("mine")
    (out / "mine").mkdir()
    (out / "mine" / "data.csv").write_text("mine too")
    files.replace_dir(out, lambda d: (d / "config.json").write_text("second"), keep_others=True)
    assert entries(tmp_path) == ["out", f"out/{files.OWNED}", "out/config.json", "out/mine", "out/mine/data.csv",
                                 "out/notes.txt"]  # fmt: skip
    assert (out / "config.json").read_text() == "second" and (out / "notes.txt").read_text() == "mine"
    files.replace_dir(out, lambda d: (d / "config.json").write_text("third"))  # not shared: replaced whole
    assert entries(tmp_path) == ["out", "out/config.json"]


def test_a_mount_point_is_built_inside_not_on_the_file_system_beside_it(tmp_path, monkeypatch):
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / ".volume.tmp-killed").mkdir()  # what a killed write into the volume left
    real = os.path.ismount
    monkeypatch.setattr(files.os.path, "ismount", lambda p: os.path.abspath(p) == str(volume) or real(p))
    busy_mount(monkeypatch, volume)
    seen = []
    files.replace_dir(volume, lambda d: seen.append(d.parent) or (d / "a.txt").write_text("a"))
    assert seen == [volume] and entries(tmp_path) == ["volume", "volume/a.txt"]


def fsync_log(monkeypatch) -> list[tuple]:
    """Every fsync (by the path its descriptor names) and rename, in order."""
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd)
    )
    monkeypatch.setattr(
        os, "replace", lambda a, b: events.append(("rename", str(a), str(b))) or replace(a, b)
    )
    return events


def test_a_folder_is_on_disk_before_its_rename_and_the_rename_after(tmp_path, monkeypatch):
    events = fsync_log(monkeypatch)
    out = tmp_path / "export"

    def fill(tmp):
        (tmp / "sub").mkdir()
        (tmp / "config.json").write_text("{}")
        (tmp / "sub" / "model.safetensors").write_bytes(b"x" * 10)

    files.replace_dir(out, fill)
    rename = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(out))
    tmp = events[rename][1]
    synced_before = {e[1] for e in events[:rename] if e[0] == "fsync"}
    assert {f"{tmp}/config.json", f"{tmp}/sub/model.safetensors", f"{tmp}/sub", tmp} <= synced_before
    assert ("fsync", str(tmp_path)) in events[rename:]


def test_a_deepspeed_checkpoint_folder_is_on_disk_before_rank_zero_renames_it(tmp_path, monkeypatch):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from draftsmith.train.infra import distributed

    def save(self, checkpoint, path, storage_options=None):  # what DeepSpeed writes: a folder of shards
        (Path(path) / "checkpoint").mkdir(parents=True)
        (Path(path) / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"w" * 8)

    monkeypatch.setattr(DeepSpeedStrategy, "__init__", lambda self, **kw: None)
    monkeypatch.setattr(DeepSpeedStrategy, "save_checkpoint", save)
    monkeypatch.setattr(DeepSpeedStrategy, "barrier", lambda self, name=None: None)
    monkeypatch.setattr(DeepSpeedStrategy, "is_global_zero", property(lambda self: True))
    strategy = distributed._atomic_deepspeed("deepspeed_stage_2")
    events = fsync_log(monkeypatch)
    path = tmp_path / "checkpoints" / "last.ckpt"
    path.parent.mkdir()
    strategy.save_checkpoint({}, path)
    tmp = str(path.with_name(f".{path.name}.tmp"))
    rename = events.index(("rename", tmp, str(path)))
    assert ("fsync", f"{tmp}/checkpoint/mp_rank_00_model_states.pt") in events[:rename]
    assert ("fsync", str(path.parent)) in events[rename:]
    assert (path / "checkpoint" / "mp_rank_00_model_states.pt").read_bytes() == b"w" * 8
