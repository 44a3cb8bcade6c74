"""bench/regen_pool.py: a peer-training pool's rendered conversations back into chat records for regeneration."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import regen_pool  # noqa: E402


def chatml(*turns: tuple[str, str], cut: str | None = None) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + (f"<|im_start|>{cut}" if cut else "")


def test_every_finished_turn_is_kept_in_order_with_its_role():
    text = chatml(("system", "Be brief."), ("user", "2+2?\nThink."), ("assistant", "4"), ("user", "And 3+3?"),
                  ("assistant", "6\n\nDone."))  # fmt: skip
    assert regen_pool.messages_of(text) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?\nThink."},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6\n\nDone."},
    ]


def test_a_turn_cut_by_max_length_is_dropped_and_so_is_a_user_turn_left_without_its_reply():
    cut_reply = chatml(("user", "Hi"), ("assistant", "Hello"), ("user", "More?"), cut="assistant\nhalf a rep")
    assert regen_pool.messages_of(cut_reply) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert regen_pool.messages_of(chatml(("system", "s"), cut="user\nan unfinished que")) == []
