"""Seeded fuzz of what a user types and feeds: random recipe overrides through the command line's override
path, random JSONL records through the conversation loader and the renderer. Every outcome is a config (every
float in it finite), rows, or an error the CLI prints as one line (``CLI_ERRORS``, what ``draftsmith.cli.main``
catches): never another exception (a traceback) and never a silent NaN. Nothing trains; seconds on a CPU."""

from __future__ import annotations

import json
import math
import random

import pytest
from tiny import tiny_tokenizer

from draftsmith import files
from draftsmith.train.config import load_config
from draftsmith.train.corpus.conversations import load_conversations
from draftsmith.train.corpus.tokens import render
from draftsmith.train.infra.preflight import flatten
from draftsmith.train.schema import to_dict

CLI_ERRORS = (ValueError, FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError,
              files.DiskFullError)  # fmt: skip
RECIPE = "configs/debug_eagle3.yaml"
VALUES = ["0", "-1", "1e30", "-1e-30", ".inf", "-.inf", ".nan", "nan", "inf", "1e400", "null", "true", "no",
          "[]", "[1, 2]", "{a: 1}", "'x'", "\"\"", "3.5", "2**4", "[", "{", "': '", "0x10", "~", "1_000",
          "-0", "eagle3", "dflash", "ddp", "auto", "bf16-mixed", "[.nan]"]  # fmt: skip


def recipe_keys() -> list[str]:
    keys = list(flatten(to_dict(load_config(RECIPE))))
    return keys + ["draft.options.ttt_steps", "draft.options.draft_vocab_size", "optim.lrr", "nosuch.key",
                   "trainer", "draft.options", "data.paths", "draft.options.capture_layer_ids"]  # fmt: skip


def finite_everywhere(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_everywhere(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(finite_everywhere(v) for v in value)
    return True


def test_random_recipe_overrides_give_a_config_or_a_one_line_error():
    rng = random.Random(48)
    keys = recipe_keys()
    outcomes = {"config": 0, "refused": 0}
    for _ in range(120):
        overrides = [f"--{rng.choice(keys)}={rng.choice(VALUES)}" for _ in range(rng.randint(1, 3))]
        try:
            config = load_config(RECIPE, overrides)
        except CLI_ERRORS as err:
            assert str(err).strip(), overrides  # says something
            outcomes["refused"] += 1
            continue
        except Exception as err:  # noqa: BLE001 - the point: anything else is a traceback at the CLI
            pytest.fail(f"{overrides}: {type(err).__name__}: {err}")
        assert finite_everywhere(to_dict(config)), overrides
        outcomes["config"] += 1
    assert outcomes["config"] > 10 and outcomes["refused"] > 10, outcomes  # both sides were reached


def random_message(rng: random.Random):
    role = rng.choice(["user", "assistant", "system", "tool", "human", "gpt", "narrator", None, 3])
    content = rng.choice(
        ["hi", "", None, 7, ["a"], [{"type": "text", "text": "x"}], {"x": 1}, "NaN", "\u0000"]
    )
    message = {rng.choice(["role", "from"]): role, rng.choice(["content", "value"]): content}
    if rng.random() < 0.2:
        message["tool_calls"] = rng.choice([[], [{"function": {"name": "f", "arguments": "{}"}}], "x", [1]])
    return message


def random_record(rng: random.Random):
    if rng.random() < 0.7:  # mostly a whole conversation with odd contents, so loading goes on to rendering
        content = rng.choice(["hi", "", "NaN", "<|im_end|>", "\u0000", "x" * 300, "<think></think>"])
        return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]}
    turns = [random_message(rng) for _ in range(rng.randint(0, 4))]
    return rng.choice([
        {"messages": turns}, {"conversations": turns}, {"prompt": "p", "response": "r"}, turns, {}, 5, "text",
        {"messages": "not a list"}, {"conversations": turns, "cut_replies": rng.choice([[0], [9], "x"])},
    ])  # fmt: skip


def test_random_jsonl_records_load_and_render_or_give_a_one_line_error(tmp_path):
    rng = random.Random(48)
    tokenizer = tiny_tokenizer()
    outcomes = {"rows": 0, "refused": 0}
    for n in range(40):
        path = tmp_path / f"data{n}.jsonl"
        lines = [json.dumps(random_record(rng)) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.1:
            lines.append(rng.choice(["{not json", "", "[1,", "\ufeff{}"]))
        path.write_text("\n".join(lines) + "\n")
        try:
            loaded = load_conversations([path])
            for row in loaded:
                render(row["messages"], tokenizer, 64)
        except CLI_ERRORS as err:
            assert str(err).strip(), lines
            outcomes["refused"] += 1
            continue
        except Exception as err:  # noqa: BLE001 - anything else is a traceback at the CLI
            pytest.fail(f"{lines}: {type(err).__name__}: {err}")
        outcomes["rows"] += 1
    assert outcomes["rows"] > 3 and outcomes["refused"] > 3, outcomes
