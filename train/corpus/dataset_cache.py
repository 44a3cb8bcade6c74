"""The rendered, packed training rows kept on disk (Arrow, ``datasets.save_to_disk``), so a restart, a
requeue and every rank after the first skip rendering and packing.

An entry is a folder ``<root>/<key>/`` named by a fingerprint of everything the rows depend on: each data
source (a file's path, size and modification time; a Hub dataset's id, split, config, revision and take;
a local dataset folder's files), the tokenizer (vocabulary and chat template), the data settings
(max_length, pack, limit, seed, ...), the versions of the libraries that tokenize and the source of the
modules that render and pack. Changing any of them makes a new entry; nothing is ever updated in place.

Rank 0 builds a missing entry and renames it into place whole (``files.replace_dir``); the other ranks
wait for it and read the same files (memory-mapped, so each rank holds no copy). The manifest holds a
SHA-256 of every file of the entry, checked on every read (about 1.4 GB/s on one core: seconds for a billion
tokens, a fraction of rendering them): an entry that cannot be read back or does not match its digests (a
cut-short file, a missing part, bytes overwritten in place) is rebuilt, never trained on.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import datasets

from draftsmith import files
from draftsmith.loading import tokenizer_fingerprint
from draftsmith.sources import HubSource, expand_sources, parse_source
from draftsmith.train.corpus.tokens import quiet_datasets

FORMAT_VERSION = 1
MANIFEST = "draftsmith_dataset.json"
"""Written last inside an entry: what it was built from, how many rows it holds and the digest of each file."""


def source_fingerprint(spec: str | Path) -> dict:
    """What identifies one data source's content without reading it: a file's resolved path, size and
    mtime; a Hub dataset's coordinates (its revision as given: pin one for data that changes); a local
    dataset folder's files with their sizes and mtimes."""
    source = parse_source(spec)
    if isinstance(source, HubSource):
        record = {"hub": source.path, "split": source.split, "config": source.config,
                  "revision": source.revision, "streaming": source.streaming, "take": source.take}  # fmt: skip
        folder = Path(source.path)
        if folder.is_dir():
            record["files"] = [
                _file_record(p, folder)
                for p in sorted(folder.rglob("*"))
                if p.is_file() and ".cache" not in p.parts
            ]
        return record
    return _file_record(Path(source))


def _file_record(path: Path, relative_to: Path | None = None) -> dict:
    stat = path.stat()
    name = str(path.relative_to(relative_to)) if relative_to else str(path.resolve())
    return {"file": name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _code_fingerprint() -> str:
    """The source of the modules whose code decides the rows: a change to rendering or packing is a new entry."""
    from draftsmith.train.corpus import conversations, tokens

    h = hashlib.sha256()
    for module in (conversations, tokens):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:16]


def dataset_key(paths: Sequence[str | Path], tokenizer, settings: Mapping) -> tuple[str, dict]:
    """(folder name, the record it hashes) for these sources rendered with this tokenizer and settings."""
    import tokenizers
    import transformers

    record = {
        "format_version": FORMAT_VERSION,
        "sources": [source_fingerprint(p) for p in expand_sources(list(paths))],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "settings": dict(settings),
        "code": _code_fingerprint(),
        "versions": {m.__name__: m.__version__ for m in (datasets, tokenizers, transformers)},
    }
    text = json.dumps(record, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20], record


def cached_dataset(
    root: str | Path,
    paths: Sequence[str | Path],
    tokenizer,
    settings: Mapping,
    build: Callable[[], datasets.Dataset],
    rank: int = 0,
    wait_timeout: float = 24 * 3600.0,
) -> datasets.Dataset:
    """The rows ``build()`` gives, from ``root``'s entry for (paths, tokenizer, settings) when it is there;
    else rank 0 builds and stores them (other ranks wait for that entry). The rows come back read from
    disk in both cases, so a first start and a restart train on the very same table."""
    key, record = dataset_key(paths, tokenizer, settings)
    entry = Path(root) / key
    found, problem = _load(entry)
    if found is not None:
        if rank == 0:
            print(f"[draftsmith] data: {len(found):,} rows read from the dataset cache {entry}", flush=True)
        return found
    if rank != 0:
        return _wait_for_entry(entry, wait_timeout)
    if entry.exists():
        print(f"[draftsmith] data: the dataset cache {entry} {problem}; building it again", flush=True)
    rows = build()

    def fill(tmp: Path) -> None:
        with quiet_datasets():  # the stage's own line says where the rows went
            rows.flatten_indices().save_to_disk(str(tmp))  # a shuffle's order written out, not an index map
        digests = {p.name: files.file_digest(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {**record, "num_rows": len(rows), "sha256": digests}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))

    files.replace_dir(entry, fill)
    print(f"[draftsmith] data: {len(rows):,} rows rendered into the dataset cache {entry}", flush=True)
    loaded, problem = _load(entry)
    if loaded is None:
        raise OSError(f"the dataset cache {entry} was written but {problem}; is its disk full or failing?")
    return loaded


def _load(entry: Path) -> tuple[datasets.Dataset | None, str]:
    """(the entry's rows, "") or (None, what is wrong) when it is absent or not whole: no manifest, a file
    missing or not matching its digest, a row count that disagrees, a file that does not read."""
    manifest = entry / MANIFEST
    if not manifest.is_file():
        return None, "has no manifest"
    try:
        record = json.loads(manifest.read_text())
        if "sha256" not in record:
            return None, "has no digests of its files (an older draftsmith wrote it)"
        expected, digests = int(record["num_rows"]), dict(record["sha256"])
        for name, digest in digests.items():
            if not (entry / name).is_file():
                return None, f"has lost {name}"
            if files.file_digest(entry / name) != digest:
                return None, f"does not hold what was written: {name} does not match its SHA-256"
        rows = datasets.load_from_disk(str(entry))
        if len(rows) != expected:  # (a cut-short Arrow file already fails to load: its messages are read)
            return None, f"holds {len(rows):,} rows where {expected:,} were written"
    except Exception as err:  # noqa: BLE001 - any unreadable entry is rebuilt, never trained on
        first = (str(err).splitlines() or [""])[0]
        return None, f"cannot be read back ({type(err).__name__}: {first})"
    return rows, ""


def _wait_for_entry(entry: Path, timeout: float) -> datasets.Dataset:
    deadline = time.monotonic() + timeout
    while (rows := _load(entry)[0]) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout:g} s for rank 0 to write the dataset cache {entry}; did rank 0 fail, or is the "
                "folder not shared by all ranks (data.cache_dir must be on a filesystem every rank sees)?"
            )
        time.sleep(1.0)
    return rows


def default_root(output_dir: str | Path) -> Path:
    """Where entries live when ``data.cache_dir`` is not set: beside the run's checkpoints."""
    return Path(output_dir) / "dataset_cache"
