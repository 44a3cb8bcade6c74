"""A kind's name is spelled once: in drafts/base.py, as a constant every other module imports.

Every string literal in the package's modules that equals a kind's name is a failure, except where the
same word names something of another project (listed below with what it names there), so a kind renamed
in one place is renamed everywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

from draftsmith.drafts import base

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("decode", "drafts", "train", "eval", "draftsmith")
KINDS = {base.EAGLE1, base.EAGLE3, base.DISTILL, base.MEDUSA, base.PEER_EAGLE3, base.NGRAM, base.DFLASH, base.PEAGLE,
         base.PEER_DFLASH}  # fmt: skip
OTHER_MEANINGS = {
    ("draftsmith/export/speculators.py", "eagle3"): "speculators' algorithm name",
    ("draftsmith/export/verify.py", "eagle3"): "speculators' algorithm name, read by its loader",
    ("drafts/eagle_import.py", "eagle3"): "speculators' algorithm name in a head it wrote",
    ("draftsmith/export/gguf_verify.py", "eagle3"): "llama.cpp's architecture name",
    ("draftsmith/llamacpp.py", "eagle3"): "llama.cpp's --spec-type draft-eagle3",
    ("draftsmith/llamacpp.py", "ngram"): "llama.cpp's ngram spec type",
    ("drafts/medusa.py", "medusa"): "transformers' base_model_prefix",
    ("draftsmith/export/medusa.py", "medusa"): "vLLM's model_type and method name",
    ("drafts/dflash_import.py", "dflash"): "speculators' model type of a DFlash draft it wrote",
    (
        "draftsmith/export/dflash_speculators.py",
        "dflash",
    ): "speculators' model type, read by vLLM's update_dflash",
    ("draftsmith/export/gguf_dflash.py", "dflash"): "llama.cpp's architecture name",
    ("draftsmith/llamacpp.py", "dflash"): "llama.cpp's --spec-type draft-dflash",
    ("draftsmith/export/peagle.py", "peagle"): "speculators' algorithm name of a P-EAGLE head, read by vLLM",
}
"""(file, word) -> what the word names there, where it is not draftsmith's kind."""


def kind_literals(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in KINDS:
            found.append((node.lineno, node.value))
    return found


def test_kind_names_are_spelled_only_in_drafts_base():
    spelled = []
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "drafts/base.py":
                continue
            spelled += [f"{rel}:{line}: {word!r}" for line, word in kind_literals(path)
                        if (rel, word) not in OTHER_MEANINGS]  # fmt: skip
    listed = "\n".join(spelled)
    assert not spelled, f"kind names spelled outside drafts/base.py (import its constants):\n{listed}"


def test_the_check_sees_a_spelled_kind(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('KIND = "eagle3"\nOTHER = "eagle"\n')
    assert kind_literals(module) == [(1, "eagle3")]


def test_every_allowance_is_still_needed():
    """An allowance whose word left its file is stale: remove it, so the list says only what is true."""
    stale = [f"{rel} {word!r}" for rel, word in OTHER_MEANINGS
             if word not in {w for _, w in kind_literals(ROOT / rel)}]  # fmt: skip
    assert not stale, f"allowances no longer needed: {stale}"
