"""Atomic writes with one file mode, for everything draftsmith leaves on disk.

A file or directory is built under a temporary name beside its destination and renamed into place,
so a crash or a full disk never leaves half a file where a reader (``--resume``, ``draftsmith eval``,
a serving engine) would pick it up. What lands is readable by everyone: files 0644, directories 0755
(``mkstemp``/``mkdtemp`` and ``safetensors`` create owner-only files, and an engine often runs as
another user). This module imports nothing else of draftsmith: every layer may use it.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


class DiskFullError(OSError):
    """A write failed for want of space; the message says what was kept and how to go on."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = 28  # ENOSPC

    def __str__(self) -> str:
        return self.args[0]


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28)", "os error 122)")


def out_of_space(err: BaseException) -> bool:
    """True when ``err`` (or an error it came from) is a write that failed for want of space: an ``OSError``
    with ENOSPC/EDQUOT, or a library's own error that carries only the text (safetensors' ``SafetensorError:
    ... No space left on device (os error 28)``)."""
    while err is not None:
        if getattr(err, "errno", None) in NO_SPACE_ERRNOS or any(t in str(err) for t in NO_SPACE_TEXT):
            return True
        err = err.__cause__ or err.__context__
    return False


FILE_MODE = 0o644
DIR_MODE = 0o755
TMP_TAG = ".tmp-"
"""Temporary names are ``.<name>.tmp-<random>``: ``remove_stale`` finds what a killed write left."""


def share(path: str | Path) -> Path:
    """Give ``path`` (and, for a directory, everything under it) the shared modes; return it."""
    path = Path(path)
    if path.is_dir():
        os.chmod(path, DIR_MODE)
        for root, dirs, files in os.walk(path):
            for d in dirs:
                os.chmod(os.path.join(root, d), DIR_MODE)
            for f in files:
                os.chmod(os.path.join(root, f), FILE_MODE)
    else:
        os.chmod(path, FILE_MODE)
    return path


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries (a rename into it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(directory: str | Path) -> Path:
    """fsync every file and folder under ``directory`` and the folder itself (deepest first), so that a
    rename of it that reaches the disk brings whole files with it, not empty ones after a power cut."""
    directory = Path(directory)
    for root, _dirs, filenames in os.walk(directory, topdown=False):
        for f in filenames:
            if not os.path.islink(os.path.join(root, f)):
                fsync_path(os.path.join(root, f))
        fsync_path(root)
    return directory


def _tmp_name(path: Path) -> str:
    return f".{path.name}{TMP_TAG}"


def write_with(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Atomically create ``path`` with ``write(tmp_path)`` (any writer that takes a file path)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=_tmp_name(path))
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        share(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def file_digest(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (hex), read a MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_text(path: str | Path, text: str) -> Path:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    return write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Atomically write ``data`` to ``path``."""
    return write_with(path, lambda tmp: tmp.write_bytes(data))


def copy_file(src: str | Path, dst: str | Path) -> Path:
    """Copy a file's bytes atomically; the copy gets the shared mode whatever the source's."""
    return write_with(dst, lambda tmp: shutil.copyfile(src, tmp))


OWNED = ".draftsmith-files"
"""In a folder draftsmith shares with its user (an export): the names of what draftsmith wrote there, one a
line, so that writing it again replaces those and keeps the user's other files (``replace_dir(keep_others=True)``)."""
IN_PLACE_ERRORS = (errno.EBUSY, errno.EXDEV)
"""What renaming a mount point (a container volume, a bind mount) onto or out of its place fails with."""


def listing(folder: str | Path, most: int = 6) -> str:
    """What a folder holds, as an error names it: ``config.json, model.safetensors, mine/ (3 entries)``."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(folder).iterdir())
    shown = ", ".join(names[:most]) + (", ..." if len(names) > most else "")
    return f"{shown} ({len(names)} entr{'y' if len(names) == 1 else 'ies'})"


def replace_dir(directory: str | Path, fill: Callable[[Path], object], keep_others: bool = False) -> Path:
    """Build a directory with ``fill(tmp_dir)`` and swap it in for ``directory`` (replacing an old one).

    The old directory is moved aside, the new one renamed into place, then the old one deleted: a
    reader sees the old whole directory or the new whole one (or, for an instant, none), and every file is
    on disk before the rename (``sync_tree``), the rename after it returns. A directory
    that cannot be renamed (a mount point: EBUSY, EXDEV) is filled in place instead, file by file, each
    file renamed into it whole, and what the new contents do not hold is removed from it. With
    ``keep_others`` the new directory records what ``fill`` wrote (``OWNED``), and entries of the old one
    that draftsmith did not write (not in its ``OWNED``; all that the new one does not hold, if it has
    none) are kept. Whatever fails, nothing temporary is left beside or inside ``directory``.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    mount = os.path.ismount(directory)  # built inside it: beside it is another file system
    if mount:
        remove_stale(directory, directory.name)  # what a killed write into it left there
    tmp = Path(tempfile.mkdtemp(dir=directory if mount else directory.parent, prefix=_tmp_name(directory)))
    try:
        fill(tmp)
        if keep_others:
            (tmp / OWNED).write_text("".join(f"{p.name}\n" for p in sorted(tmp.iterdir())), encoding="utf-8")
        share(tmp)
        sync_tree(tmp)
        if not mount:
            try:
                _swap(directory, tmp, _others(directory, tmp) if keep_others else [])
                fsync_path(directory.parent)
                return directory
            except OSError as err:
                if err.errno not in IN_PLACE_ERRORS:
                    raise
        _fill_in_place(directory, tmp, keep_others)
        sync_tree(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _others(directory: Path, new: Path) -> list[str]:
    """Entries of an old ``directory`` that draftsmith did not write there and ``new`` does not replace."""
    if not directory.is_dir():
        return []
    owned_file = directory / OWNED
    owned = set(owned_file.read_text(encoding="utf-8").split("\n")) if owned_file.is_file() else set()
    taken = {p.name for p in new.iterdir()} | owned | {OWNED}
    temporary = _tmp_name(directory)
    return sorted(
        p.name for p in directory.iterdir() if p.name not in taken and not p.name.startswith(temporary)
    )


def _link_or_copy(src: Path, dst: Path) -> None:
    """``src`` (a file or a folder) at ``dst`` too: hard links where the file system has them, else copies."""

    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    elif src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        link(src, dst)


def _swap(directory: Path, tmp: Path, others: list[str]) -> None:
    """Rename ``tmp`` into ``directory``'s place, ``others`` of the old one carried over; the old one is
    deleted after, or put back if the swap fails. Raises what the renames raise (EBUSY on a mount point)."""
    for name in others:
        _link_or_copy(directory / name, tmp / name)
    old = None
    if directory.exists():
        old = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.old-"))
    swapped = False
    try:
        if old is not None:
            os.replace(directory, old / directory.name)
        try:
            os.replace(tmp, directory)
            swapped = True
        except BaseException:
            if old is not None and (old / directory.name).exists():
                os.replace(old / directory.name, directory)  # put the previous one back
            raise
    finally:
        if old is not None and (swapped or not (old / directory.name).exists()):
            shutil.rmtree(old, ignore_errors=True)  # never the previous one while it is not back in place


def _fill_in_place(directory: Path, new: Path, keep_others: bool) -> None:
    """Move every entry of ``new`` into ``directory`` (each file renamed whole, or copied whole across file
    systems), then remove the old entries the new contents do not hold: those draftsmith wrote, with
    ``keep_others``; all but the temporary ones otherwise."""
    directory.mkdir(parents=True, exist_ok=True)
    temporary = _tmp_name(directory)
    stale = {p.name for p in directory.iterdir() if not p.name.startswith(temporary)}
    stale -= {p.name for p in new.iterdir()} | (set(_others(directory, new)) if keep_others else set())
    for root, dirs, filenames in os.walk(new):
        rel = Path(root).relative_to(new)
        for d in dirs:
            (directory / rel / d).mkdir(exist_ok=True)
        for f in sorted(filenames, key=lambda f: (rel / f).as_posix() == OWNED):  # the record last
            src, dst = Path(root) / f, directory / rel / f
            try:
                os.replace(src, dst)
            except OSError as err:
                if err.errno != errno.EXDEV:
                    raise
                copy_file(src, dst)
    for name in sorted(stale):
        path = directory / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def check_writable(directory: str | Path, what: str) -> Path:
    """Prove that ``directory`` can be written (a file made and removed in it, or in the nearest folder
    above it that exists, since it is created later) before any work starts; a clear error otherwise."""
    directory = Path(directory)
    probe = directory
    while not probe.exists():
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(f"{probe} is a file")
        fd, name = tempfile.mkstemp(dir=probe, prefix=".draftsmith-write-check-")
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise PermissionError(
            f"{what} {directory} cannot be written ({err.strerror or err}); nothing was run. Pass a folder you "
            "can write to."
        ) from err
    return directory


def json_text(value) -> str:
    """``value`` as JSON that every parser reads: NaN and infinities (an undefined rate) become null."""

    def finite(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(value), indent=2, allow_nan=False, ensure_ascii=False)


def json_error(err, text: str) -> str:
    """A ``json.JSONDecodeError`` as a whole sentence: what is wrong, at which line and column, with the
    text around it (Python's own message stops mid-sentence: "Invalid control character at")."""
    msg = err.msg.rstrip(": ")
    if msg.startswith("Unterminated string"):
        msg = "a string that starts here never ends (a missing closing quote, or the line was cut short)"
    elif msg.startswith("Invalid control character"):
        msg = "a raw control character (a tab or newline) inside a string; write it as \\t or \\n"
    lines = text.splitlines() or [""]
    line = lines[min(err.lineno, len(lines)) - 1]
    lo = max(err.colno - 1 - 30, 0)
    snippet = line[lo : err.colno - 1 + 30]
    return (
        f"{msg} at line {err.lineno}, column {err.colno}:\n    {snippet}\n    {' ' * (err.colno - 1 - lo)}^"
    )


GZIP_MAGIC = b"\x1f\x8b"


def open_text(path: str | Path):
    """Open a UTF-8 text file for reading, gzip-compressed or not (told by its first bytes, not its name);
    a byte-order mark at the start, which Windows editors write, is skipped (CRLF line ends are read too)."""
    path = Path(path)
    with path.open("rb") as f:
        compressed = f.read(2) == GZIP_MAGIC
    if compressed:
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return path.open(encoding="utf-8-sig")


def read_jsonl(path: str | Path, holds: str):
    """``(line number, record)`` for every non-blank line of a JSONL file (gzip-compressed or not); a
    malformed line is an error that names ``file:line``, the column and the text around it (``holds``:
    what a line is, for the message)."""
    path = Path(path)
    with open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(
                    line.rstrip("\r\n")
                )  # a line cut short: "never ends", not a control character
            except json.JSONDecodeError as err:
                what = json_error(err, line).replace("at line 1, column", "at column", 1)
                raise ValueError(
                    f"{path}:{lineno}: malformed JSON (each line holds {holds}): {what}"
                ) from err
            yield lineno, record


def remove_stale(parent: str | Path, name: str) -> list[Path]:
    """Delete what killed writes of ``parent/name`` left behind (its temporary and set-aside copies)."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    stale = sorted([*parent.glob(f".{name}{TMP_TAG}*"), *parent.glob(f".{name}.old-*")], key=lambda p: p.name)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return stale


def read_json(path: str | Path, fix: str = "", expect_object: bool = True):
    """The JSON in ``path`` (an object unless ``expect_object`` is False). A malformed file is a ``ValueError``
    whose first line names it, what is wrong at which line and column, and ``fix`` (what to do; Python's own
    message names no file), then the text around the fault."""
    path = Path(path)
    then = f" {fix}." if fix else ""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not JSON: byte {err.start} is not UTF-8 text.{then}") from err
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        what, _, where = json_error(err, text).partition(":\n")
        raise ValueError(f"{path} is not valid JSON: {what}.{then}\n{where}") from err
    if expect_object and not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__} where an object belongs.{then}")
    return value


SAFETENSORS_HEADER_LIMIT = 100_000_000
"""The largest header the safetensors library reads (its ``N_MAX_HEADER``); a larger length is garbage."""


def safetensors_problem(path: str | Path) -> str | None:
    """What is wrong with the safetensors file ``path`` ("cut short: ...", "corrupt: ..."), or None if whole.

    Read from the format itself (8 bytes of header length, a JSON header, then every tensor's bytes at the
    offsets it gives), without loading a tensor: the safetensors library says "incomplete metadata" and
    names no file, and a truncated copy is what a killed ``cp`` or download leaves.
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"cut short: {size} bytes, fewer than the 8 that give a safetensors header's length"
        length = int.from_bytes(prefix, "little")
        if length > SAFETENSORS_HEADER_LIMIT:
            return f"not a safetensors file: its first 8 bytes give a header of {length:,} bytes"
        if 8 + length > size:
            return f"cut short: {size:,} bytes, and its header alone takes {8 + length:,}"
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "corrupt: its header is not valid JSON (not a safetensors file, or overwritten)"
    if not isinstance(header, dict):
        return "corrupt: its header is not a JSON object"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2
    ]
    if len(ends) != len([n for n in header if n != "__metadata__"]):
        return "corrupt: its header lists a tensor without data offsets"
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"cut short: {size:,} bytes of the {expected:,} its header lists"
    if size > expected:
        return f"corrupt: {size:,} bytes where its header lists {expected:,} (safetensors refuses the extra bytes)"
    return None


def check_model_files(directory: str | Path, fix: str) -> Path:
    """Refuse a saved model directory with a partial or corrupt file: every ``*.json`` parses, every
    ``*.safetensors`` is whole, every shard an index names exists. One ``ValueError`` naming the file, what
    is wrong and ``fix`` (what to do), before anything loads or is written from it."""
    directory = Path(directory)
    for path in sorted(directory.glob("*.json")):
        read_json(path, fix, expect_object=False)
    for index in sorted(directory.glob("*.safetensors.index.json")):
        shards = set((read_json(index, fix).get("weight_map") or {}).values())
        missing = sorted(s for s in shards if not (directory / s).is_file())
        if missing:
            raise FileNotFoundError(
                f"{index} names weight files that are not there: {', '.join(missing)}. {fix}."
            )
    for path in sorted(directory.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem:
            raise ValueError(f"{path} is {problem}. {fix}.")
    return directory


def nonfinite_tensor(directory: str | Path) -> tuple[Path, str, int] | None:
    """The first tensor of a saved model directory (its ``*.safetensors``) with an infinite or NaN entry, as
    (file, tensor name, how many such entries), or None when every floating-point tensor is finite. Reads
    one tensor at a time."""
    import torch
    from safetensors import safe_open

    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                tensor = weights.get_tensor(name)
                if not tensor.is_floating_point():
                    continue
                finite = torch.isfinite(tensor if tensor.element_size() > 1 else tensor.float())  # float8 too
                if not bool(finite.all()):
                    return path, name, int((~finite).sum())
    return None


def check_finite(directory: str | Path, fix: str) -> Path:
    """Refuse a saved model directory with a non-finite tensor (``nonfinite_tensor``): one ``ValueError``
    naming the file, the tensor and ``fix``, before anything is written or decoded from it."""
    found = nonfinite_tensor(directory)
    if found is not None:
        path, name, count = found
        raise ValueError(
            f"{path} holds a tensor that is not finite: {name} has {count:,} inf or NaN entries. {fix}."
        )
    return Path(directory)


def checkpoint_problem(path: str | Path) -> str | None:
    """What is wrong with a ``torch.save`` file (a Lightning ``.ckpt``), or None if it reads as whole.

    ``torch.save`` writes a zip archive whose directory sits at its end, so a copy cut short has none;
    torch then says "failed finding central directory" and names no file. Only the directory and the
    member extents are read here, not the bytes (a checkpoint may be gigabytes). A folder (DeepSpeed's
    checkpoints) is not checked.
    """
    import zipfile

    path = Path(path)
    if path.is_dir():
        return None
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except zipfile.BadZipFile:
        return (
            f"cut short or corrupt: its {size:,} bytes hold no archive directory (torch.save writes it last)"
        )
    end = max((m.header_offset + m.compress_size for m in members), default=0)
    if not members or end > size:
        return f"corrupt: its archive directory lists data up to byte {end:,} of {size:,}"
    return None


def check_checkpoint(path: str | Path, fix: str) -> Path:
    """Refuse a damaged ``.ckpt`` before a run resumes from it: one ``ValueError`` naming it and ``fix``."""
    problem = checkpoint_problem(path)
    if problem:
        raise ValueError(f"{path} is {problem}. {fix}.")
    return Path(path)
