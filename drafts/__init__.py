"""The kinds of draft behind one protocol (``decode/drafter.py``), one record each (``drafts/base.py``)."""

from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.drafts.base import (
    DraftKind,
    build_drafter,
    draft_kind,
    kind_names,
    kind_of_checkpoint,
    register,
)

__all__ = [
    "DraftKind",
    "Drafter",
    "Proposal",
    "build_drafter",
    "draft_kind",
    "kind_names",
    "kind_of_checkpoint",
    "register",
]
