"""The one "did you mean" every error that names an unknown key, kind, engine or data set offers."""

from __future__ import annotations

import difflib
import os


def closest(word: str, choices) -> str | None:
    """The choice most like ``word`` (difflib's ratio, at least 0.6), ties broken by the longest common prefix:
    ``eagle4`` is closer to ``eagle3`` than to ``peagle``, which difflib alone scores alike."""
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=len(choices) or 1)
    if not close:
        return None
    score = difflib.SequenceMatcher(None, word, close[0]).ratio()
    tied = [c for c in close if difflib.SequenceMatcher(None, word, c).ratio() == score]
    return max(tied, key=lambda c: len(os.path.commonprefix([word, c])))
