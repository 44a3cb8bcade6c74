"""Faults a user meets at the ends of the path, tried through the real entry points: an export onto a mount
point or a read-only place, an export folder shared with the user's own files, a folder that is no draft
given to publish or eval, a too-long warm-up prompt with --truncate-prompts, and what the first screen
and a log file show."""

from __future__ import annotations

import errno
import os

from test_export import eagle_dir, target  # noqa: F401 (fixtures)
from test_files import busy_mount, entries

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
