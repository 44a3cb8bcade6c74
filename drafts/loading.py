"""Tell which draft kind a checkpoint directory holds."""

from __future__ import annotations

import json
from pathlib import Path

DRAFT_KIND_KEY = "draftsmith_kind"


def kind_of_checkpoint(spec: str) -> str:
    """The ``draftsmith_kind`` recorded in ``spec/config.json``; ``causal_lm`` for any other model."""
    config = Path(spec) / "config.json"
    if config.is_file():
        kind = json.loads(config.read_text()).get(DRAFT_KIND_KEY)
        if kind:
            return kind
    return "causal_lm"
