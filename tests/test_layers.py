"""The direction of imports: app (cli, quickstart, export, publish) -> train, eval -> drafts -> decode ->
model loading and io. A lower layer never imports a higher one, not even inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"decode": "decode", "drafts": "drafts", "eval": "eval", "train": "train", "draftsmith": ""}
"""Top-level folder -> its subpackage of ``draftsmith`` (the app folder is the package itself)."""
LAYERS = [
    (
        "model loading and io",
        ("draftsmith.files", "draftsmith.hub", "draftsmith.loading", "draftsmith.sources"),
    ),
    ("decode", ("draftsmith.decode",)),
    ("drafts", ("draftsmith.drafts",)),
    ("train and eval", ("draftsmith.train", "draftsmith.eval")),
    ("app", ("draftsmith",)),  # everything else: cli, quickstart, export/, publish/, llamacpp, ...
]


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = ["draftsmith", *([FOLDERS[folder]] if FOLDERS[folder] else []), *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The lowest layer whose prefix names ``module`` (the app is whatever else is draftsmith's)."""
    for i, (_, prefixes) in enumerate(LAYERS[:-1]):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return len(LAYERS) - 1


def imports(path: Path) -> list[str]:
    """Every draftsmith module ``path`` imports, at the top or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from draftsmith import files` imports draftsmith.files; `from draftsmith.x import Y`, draftsmith.x
            found += (
                [f"{node.module}.{a.name}" for a in node.names]
                if node.module == "draftsmith"
                else [node.module]
            )
    return [m for m in found if m.startswith("draftsmith.")]


SOURCES = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_higher_layer(path):
    here = layer_of(module_name(path))
    higher = [m for m in imports(path) if layer_of(m) > here]
    assert not higher, f"{module_name(path)} ({LAYERS[here][0]}) imports {higher} from a higher layer"


def test_the_check_fails_on_a_decoder_that_imports_a_draft_kind(tmp_path):
    bad = ROOT / "decode" / "speculative.py"
    source = bad.read_text() + "\n\ndef _f():\n    from draftsmith.drafts.eagle import EagleHead\n"
    (tmp_path / "speculative.py").write_text(source)
    found = imports(tmp_path / "speculative.py")
    assert "draftsmith.drafts.eagle" in found and layer_of("draftsmith.drafts.eagle") > layer_of(
        module_name(bad)
    )
