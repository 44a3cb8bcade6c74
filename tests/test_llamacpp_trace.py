"""Reading llama.cpp's acceptance from its server trace, and the flags each draft kind gets (no build needed)."""

from __future__ import annotations

import pytest
from benchlib.llamacpp_runs import step_counts

from draftsmith import llamacpp

TRACE = """\
srv  update_slots: id  0 | task 3 | accepted 2/4 draft tokens, new n_past = 40
slot update_slots: id  0 | task 3 | something else
srv  update_slots: id  0 | task 3 | accepted 0/ 4 draft tokens, new n_past = 41
srv  update_slots: id  0 | task 3 | accepted 4/4 draft tokens, new n_past = 46
"""


def test_step_counts_reads_each_verify_step_and_the_tokens_left_over():
    accepted, proposed = step_counts(TRACE, 12)
    # three verify steps commit 3 + 1 + 5 = 9 tokens; with the prompt pass's first, 2 were decoded alone
    assert accepted == [2, 0, 4, 0, 0] and proposed == [4, 4, 4, 0, 0]


def test_step_counts_of_a_last_step_cut_by_n_predict_leaves_nothing_over():
    assert step_counts(TRACE, 8) == ([2, 0, 4], [4, 4, 4])
    assert step_counts("", 5) == ([0, 0, 0, 0], [0, 0, 0, 0])


def test_speculative_args_per_kind():
    assert "--spec-type" not in llamacpp.speculative_args(None, 5)
    ngram = llamacpp.speculative_args("ngram", 3)
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-simple" and "3" in ngram
    head = llamacpp.speculative_args("eagle3", 5, "head.gguf")
    assert head[head.index("--spec-type") + 1] == "draft-eagle3" and head[-1] == "head.gguf"
    small = llamacpp.speculative_args("draft", 5, "small.gguf")
    assert small[small.index("--spec-type") + 1] == "draft-simple"
    with pytest.raises(ValueError, match="needs its GGUF"):
        llamacpp.speculative_args("eagle3", 5)
    with pytest.raises(ValueError, match="unknown llama.cpp draft kind 'medusa'"):
        llamacpp.speculative_args("medusa", 5)
