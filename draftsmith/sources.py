"""Where data comes from: a local file, a file shipped with draftsmith (``builtin:NAME``), or a dataset
loaded by ``datasets.load_dataset`` (``hf:ID[:SPLIT][?key=value&...]``).

The spec is parsed here, once, for every reader (training data, ``draftsmith data``, eval prompts), so
a spelling that works in a recipe works on every command line. Loading a Hub dataset is the reader's
job (``train/corpus/conversations.py``); this module imports nothing but the standard library and draftsmith's io.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl

from draftsmith.spelling import closest

BUILTIN_DIR = Path(__file__).resolve().parent / "data"
"""The shipped data (package data: present in a wheel too); its README gives sources and licenses."""
BUILTIN = {
    "sharegpt_1000": "train/sharegpt_1000.jsonl.gz",
    "gsm8k_train": "train/gsm8k_train.jsonl.gz",
    "gpteacher_codegen": "train/gpteacher_codegen.json.gz",
    "dev_prompts": "dev/prompts.jsonl.gz",
}
"""Built-in name -> file under ``BUILTIN_DIR`` (gzip-compressed: a quarter of the bytes in a checkout, a
wheel and what a device call carries; every reader takes .gz files)."""
BUILTIN_TRAIN = ("builtin:sharegpt_1000", "builtin:gsm8k_train", "builtin:gpteacher_codegen")
"""The shipped training conversations, in the quickstart's order (ShareGPT chat, GSM8K math, GPTeacher code)."""
BUILTIN_PREFIX = "builtin:"
HUB_PREFIX = "hf:"
HUB_FORM = "hf:ID_OR_FOLDER[:SPLIT][?config=NAME&revision=REV&streaming=true&take=N]"
HUB_KEYS = ("config", "revision", "streaming", "take")


class DataSourceError(ValueError):
    """A data spec that cannot be read: the message names the spec and what to do."""


@dataclass(frozen=True)
class HubSource:
    """A dataset for ``datasets.load_dataset``: a Hub id or a local folder laid out like a Hub dataset
    repository (data files, and the README's ``configs`` metadata where it has one)."""

    path: str
    split: str = "train"
    config: str | None = None
    revision: str | None = None
    streaming: bool = False
    take: int | None = None
    """Read at most this many rows (the first ones, in the dataset's order); required with streaming,
    so memory is bounded by the rows taken, not the size of the dataset."""

    @property
    def name(self) -> str:
        """How records of this source are named (``source_id`` prefixes, error messages)."""
        return f"{HUB_PREFIX}{self.path}:{self.split}" + (f"?config={self.config}" if self.config else "")

    def __str__(self) -> str:
        return self.name


def builtin_path(name: str) -> Path:
    """The file of a built-in name (with or without the ``builtin:`` prefix); a did-you-mean error else."""
    name = name.removeprefix(BUILTIN_PREFIX)
    if name not in BUILTIN:
        close = closest(name, BUILTIN)
        hint = f"did you mean builtin:{close}? " if close else ""
        raise DataSourceError(
            f"builtin:{name} is not a built-in data set; {hint}the built-in ones are "
            + ", ".join(f"builtin:{n}" for n in BUILTIN)
        )
    path = BUILTIN_DIR / BUILTIN[name]
    if not path.is_file():
        raise DataSourceError(
            f"builtin:{name} should be {path}, which is missing: this draftsmith installation is incomplete "
            "(reinstall it: pip install --force-reinstall draftsmith, or bash scripts/setup.sh in a checkout)"
        )
    return path


def parse_source(spec: str | Path) -> Path | HubSource:
    """A local path, the file of a ``builtin:`` name, or a ``HubSource`` for an ``hf:`` spec."""
    if isinstance(spec, Path):
        return spec
    if spec.startswith(BUILTIN_PREFIX):
        return builtin_path(spec)
    if spec.startswith(HUB_PREFIX):
        return _parse_hub(spec)
    return Path(spec)


GLOB_CHARS = "*?["


def expand_sources(specs: Sequence[str | Path]) -> list[str | Path]:
    """The specs with every local-path pattern (``regen/part-*.jsonl``: the shards of a sharded
    ``data regenerate``) replaced by the files it matches, sorted; a pattern that matches nothing is an
    error naming it. ``builtin:`` and ``hf:`` specs pass through."""
    expanded: list[str | Path] = []
    for spec in specs:
        text = str(spec)
        if text.startswith((BUILTIN_PREFIX, HUB_PREFIX)) or not any(c in text for c in GLOB_CHARS):
            expanded.append(spec)
            continue
        path = Path(text)
        anchor = Path(path.anchor) if path.is_absolute() else Path()
        matches = sorted(p for p in anchor.glob(str(path.relative_to(anchor))) if p.is_file())
        if not matches:
            raise DataSourceError(
                f"{text} matches no file; check the pattern (shards are e.g. regen/part-*.jsonl)"
            )
        expanded.extend(matches)
    return expanded


def check_source(spec: str | Path, what: str = "data file") -> None:
    """Fail now, before a model loads, on a local file that is missing or a spec that does not parse
    (a Hub dataset is only found when it is loaded); a pattern must match at least one file."""
    if any(c in str(spec) for c in GLOB_CHARS) and not str(spec).startswith((BUILTIN_PREFIX, HUB_PREFIX)):
        expand_sources([spec])
        return
    source = parse_source(spec)
    if isinstance(source, Path) and not source.is_file():
        raise FileNotFoundError(
            f"{what} {spec} does not exist; give a JSON/JSONL file, a built-in data set "
            f"({', '.join(BUILTIN_PREFIX + n for n in BUILTIN)}) or a dataset as {HUB_FORM}"
        )


def source_name(source: Path | HubSource) -> str:
    """What records of a source are named after (``source_id`` = "name:record index"): a file's name
    without ``.gz`` (compressing a file keeps its ids), a dataset's spec."""
    return source.name.removesuffix(".gz")


def _parse_hub(spec: str) -> HubSource:
    body, _, query = spec[len(HUB_PREFIX) :].partition("?")
    path, split = body, "train"
    head, sep, tail = body.rpartition(":")
    if sep and "/" not in tail:
        path, split = head, tail
    if not path or not split:
        raise DataSourceError(f"{spec!r} names no dataset; write it as {HUB_FORM}")
    options: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)) if query else []:
        if key not in HUB_KEYS:
            raise DataSourceError(
                f"{spec!r}: unknown option {key!r}; the options are {', '.join(HUB_KEYS)} ({HUB_FORM})"
            )
        options[key] = value
    streaming = options.get("streaming", "false").lower()
    if streaming not in ("true", "false", "1", "0"):
        raise DataSourceError(f"{spec!r}: streaming must be true or false, got {options['streaming']!r}")
    take = None
    if "take" in options:
        try:
            take = int(options["take"])
        except ValueError:
            take = 0
        if take < 1:
            raise DataSourceError(
                f"{spec!r}: take must be a positive number of rows, got {options['take']!r}"
            )
    source = HubSource(
        path=path,
        split=split,
        config=options.get("config") or None,
        revision=options.get("revision") or None,
        streaming=streaming in ("true", "1"),
        take=take,
    )
    if source.streaming and source.take is None:
        raise DataSourceError(
            f"{spec!r}: streaming reads a dataset too large to hold, so say how many rows to read: add "
            "&take=N (memory then stays bounded by N rows, whatever the size of the dataset)"
        )
    return source
