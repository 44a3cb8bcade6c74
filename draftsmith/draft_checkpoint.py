"""Find what a draft checkpoint argument points at: the draft directory, its run and its recipe.

``draftsmith publish`` and ``draftsmith export`` accept a training run directory (it holds ``draft/``
and ``config.yaml``), a draft directory itself (it holds ``config.json``), or a Hub id (downloaded
once, see ``draftsmith.hub``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftsmith.drafts.base import DraftKind, draft_dir_of, kind_of_config, read_draft_config
from draftsmith.hub import resolve_pretrained

RECIPE_FILES = ("train_config.yaml",)  # written into draft/ by the training loop
RUN_RECIPE = "config.yaml"


@dataclass
class DraftCheckpoint:
    """A draft directory, the run that produced it (if known) and what kind of draft it is."""

    spec: str
    draft_dir: Path
    run_dir: Path | None
    kind: DraftKind
    config: dict

    @property
    def target(self) -> dict:
        """The record of the target the draft was trained for (name, sizes, tokenizer fingerprint)."""
        return dict(self.config.get(self.kind.target_key) or {})

    def recipe_path(self) -> Path | None:
        """The training recipe: ``draft/train_config.yaml`` (resolved), else ``<run>/config.yaml``."""
        for name in RECIPE_FILES:
            if (self.draft_dir / name).is_file():
                return self.draft_dir / name
        if self.run_dir is not None and (self.run_dir / RUN_RECIPE).is_file():
            return self.run_dir / RUN_RECIPE
        return None


def locate_checkpoint(spec: str) -> DraftCheckpoint:
    """Resolve ``spec`` (run dir, draft dir or Hub id) to a ``DraftCheckpoint``; clear errors otherwise."""
    path = Path(resolve_pretrained(spec, what="checkpoint"))
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {spec!r} does not exist (pass a run directory or a draft directory)"
        )
    draft_dir = draft_dir_of(path)
    if not (draft_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{spec!r} holds no draft: expected config.json in it (a draft directory) or draft/config.json "
            "(a `draftsmith train` run directory). Has the run validated at least once?"
        )
    if draft_dir != path:
        run_dir = path
    else:
        run_dir = path.parent if (path.parent / RUN_RECIPE).is_file() else None
    config = read_draft_config(draft_dir)  # every file whole and parsed, or one error naming it
    return DraftCheckpoint(spec, draft_dir, run_dir, kind_of_config(config), config)
