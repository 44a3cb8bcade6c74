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
KINDS = set(base.KINDS) - {base.LAYERS}
"""Every registered kind's name but ``layers``, which is also the word for a model's layers everywhere."""
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
    ("drafts/mirror.py", "mirror"): "the EagleConfig attribute that holds a mirror head's settings",
    ("eval/mirror_stats.py", "mirror"): "the decoding mode's key in report.json",
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


KIND_CONSTANTS = {name: value for name, value in vars(base).items()
                  if name.isupper() and isinstance(value, str) and value in base.KINDS}  # fmt: skip
"""``drafts/base.py``'s constant name -> the kind it names."""
MAX_OTHER_FILES = 3
"""Where a kind may be named outside its own files (ARCHITECTURE's rule: a kind lives in one place)."""


def own_files(kind: str) -> set[str]:
    """The kind's own modules, as its line of ``drafts/base.KINDS`` names them, and the registry itself."""
    parts = base.KINDS[kind]
    own = {"drafts/base.py", f"drafts/{parts.drafts}.py"}
    own |= {f"train/objectives/{parts.objective}.py"} if parts.objective else set()
    return own | ({f"draftsmith/export/{parts.export}.py"} if parts.export else set())


def kinds_named(path: Path) -> set[str]:
    """The kinds a module names through ``drafts/base.py``'s constants (imported, or read as ``base.X``)."""
    named = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("drafts.base"):
            named |= {KIND_CONSTANTS[a.name] for a in node.names if a.name in KIND_CONSTANTS}
        elif isinstance(node, ast.Attribute) and node.attr in KIND_CONSTANTS:
            named.add(KIND_CONSTANTS[node.attr])
    return named


def files_naming(root: Path) -> dict[str, set[str]]:
    """kind -> the package's modules under ``root`` that name it outside the kind's own files."""
    found: dict[str, set[str]] = {kind: set() for kind in base.KINDS}
    for folder in PACKAGE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for kind in kinds_named(path):
                if rel not in own_files(kind):
                    found[kind].add(rel)
    return found


def test_a_kind_is_named_in_few_files_outside_its_own():
    """A kind is added in its own files plus a registry line; the app may choose it by name (the recipe's
    default, the quickstart) in a few places, but no engine or loop branches on it."""
    crowded = {
        kind: sorted(files) for kind, files in files_naming(ROOT).items() if len(files) > MAX_OTHER_FILES
    }
    assert not crowded, f"kinds named in more than {MAX_OTHER_FILES} files outside their own: {crowded}"


def test_the_count_sees_a_kind_named_elsewhere(tmp_path):
    for number in range(MAX_OTHER_FILES + 1):
        module = tmp_path / "eval" / f"m{number}.py"
        module.parent.mkdir(exist_ok=True)
        module.write_text(
            "from draftsmith.drafts.base import DFLASH\nfrom draftsmith.drafts import base\nbase.MEDUSA\n"
        )
    found = files_naming(tmp_path)
    assert (
        len(found[base.DFLASH]) == len(found[base.MEDUSA]) == MAX_OTHER_FILES + 1 and not found[base.EAGLE3]
    )
