"""Hugging Face Hub ids as ``--draft`` / ``--target`` / checkpoint arguments: download once, then local.

``resolve_pretrained(spec)`` returns a local directory for a spec: an existing path as it is, a Hub
id (``org/name`` or ``org/name@revision``) from the local Hugging Face cache when it is there, else
downloaded once with ``huggingface_hub.snapshot_download`` into that cache. Without network (or
with ``HF_HUB_OFFLINE=1``) and nothing cached, it raises ``FileNotFoundError`` naming the id and
saying that it needs network once, or a local path.
"""

from __future__ import annotations

import re
from pathlib import Path

import huggingface_hub
from huggingface_hub import errors as hub_errors

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
"""``org/name`` with an optional ``@revision`` (branch, tag or commit)."""

SKIPPED_FILES = ["*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack", "*.onnx", "*.tflite", "original/*"]
"""Weights in formats draftsmith never reads: not downloaded."""


KNOWN_TARGETS = {"smollm2-135m-instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}
"""Target aliases draftsmith knows → (Hub id, license)."""


def hub_id_of_target(target: dict) -> str | None:
    """The Hub id of a draft's target record: a known alias's id, the recorded name if it is a Hub id, else None."""
    name = str(target.get("name") or "")
    if name in KNOWN_TARGETS:
        return KNOWN_TARGETS[name][0]
    return name if is_hub_id(name) else None


def is_hub_id(spec: str) -> bool:
    """True for ``org/name[@revision]`` that is not an existing local path."""
    return bool(HUB_ID.match(spec)) and not Path(spec).exists()


def split_revision(spec: str) -> tuple[str, str | None]:
    """``org/name@rev`` → (``org/name``, ``rev``); no ``@`` → (spec, None)."""
    repo_id, _, revision = spec.partition("@")
    return repo_id, revision or None


def resolve_pretrained(spec: str, what: str = "model") -> str:
    """A local directory for ``spec``: a path as it is, a Hub id from the cache or downloaded once.

    ``what`` names the argument in error messages ("draft", "target", ...). Anything that is neither
    an existing path nor shaped like a Hub id is returned unchanged for the caller to judge.
    """
    if Path(spec).exists() or not HUB_ID.match(spec):
        return spec
    repo_id, revision = split_revision(spec)
    kwargs = dict(repo_id=repo_id, revision=revision, ignore_patterns=SKIPPED_FILES)
    try:
        return huggingface_hub.snapshot_download(**kwargs, local_files_only=True)
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, FileNotFoundError):
        pass  # not cached yet: download it once
    try:
        return huggingface_hub.snapshot_download(**kwargs)
    except hub_errors.GatedRepoError as err:
        raise FileNotFoundError(
            f"{what} {spec!r} is a gated repository: accept its terms on huggingface.co and log in with "
            "`hf auth login`, or pass a local directory."
        ) from err
    except (hub_errors.RepositoryNotFoundError, hub_errors.RevisionNotFoundError) as err:
        raise FileNotFoundError(
            f"{what} {spec!r} is not a local path, and the Hugging Face Hub has no repository "
            f"{repo_id!r}{f' at revision {revision!r}' if revision else ''} (or it is private: log in with "
            "`hf auth login`). Check the id, or pass a local directory."
        ) from err
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, OSError) as err:
        raise FileNotFoundError(
            f"{what} {spec!r} is not a local path and is not in the Hugging Face cache, and it could not be "
            f"downloaded ({type(err).__name__}): downloading a Hub id needs network once (and HF_HUB_OFFLINE "
            "unset). Connect and retry, or pass a local directory."
        ) from err
