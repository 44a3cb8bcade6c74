"""The direction of imports: app (cli, quickstart, export, publish) -> train, eval -> drafts -> decode ->
model loading and io. A lower layer never imports a higher one, not even inside a function, not by a
relative import and not by naming its module in a string (``importlib.import_module("draftsmith.x")``,
a registry's ``"draftsmith.train.objectives.eagle"``). And no two modules of one folder import each
other in a circle (type-only imports included): a folder's modules stack, one on another."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"decode": "decode", "drafts": "drafts", "eval": "eval", "train": "train", "draftsmith": ""}
"""Top-level folder -> its subpackage of ``draftsmith`` (the app folder is the package itself)."""
LAYERS = [
    (
        "model loading and io",
        # llamacpp and vllm drive external engines (llama-server, vllm serve over HTTP; servers is their
        # common process handling, openai_client the HTTP client of any OpenAI-compatible server): io,
        # which `data regenerate --engine` (train), `eval --server` (eval) and the benches use alike
        (
            "draftsmith.files",
            "draftsmith.hub",
            "draftsmith.llamacpp",
            "draftsmith.loading",
            "draftsmith.openai_client",
            "draftsmith.servers",
            "draftsmith.sources",
            "draftsmith.spelling",
            "draftsmith.vllm",
        ),
    ),
    ("decode", ("draftsmith.decode",)),
    ("drafts", ("draftsmith.drafts",)),
    ("train and eval", ("draftsmith.train", "draftsmith.eval")),
    ("app", ("draftsmith",)),  # everything else: cli, quickstart, export/, publish/, ...
]

KNOWN_UPWARD_STRINGS: set[tuple[str, str]] = set()
"""(module, the higher module it names in a string) that may stay while being removed. Empty since the
drafts' records stopped naming train/objectives/ modules (objectives are found through the train-side
registry); keep it so, never grow it."""
KNOWN_CIRCLES: set[frozenset[str]] = set()
"""Circles inside a folder found when the circle check landed; being removed. Empty it, never grow it."""


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = ["draftsmith", *([FOLDERS[folder]] if FOLDERS[folder] else []), *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))
MODULES = {module_name(p) for p in SOURCES}
"""Every draftsmith module and package, by its import name."""


def layer_of(module: str) -> int:
    """The lowest layer whose prefix names ``module`` (the app is whatever else is draftsmith's)."""
    for i, (_, prefixes) in enumerate(LAYERS[:-1]):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return len(LAYERS) - 1


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name of ``node``'s module: ``from ..x import y`` in draftsmith.decode.z is draftsmith.x."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(path: Path, as_module: str | None = None, modules: set[str] = MODULES) -> list[str]:
    """Every draftsmith module ``path`` imports, at the top or inside a function, absolutely or
    relatively. ``from draftsmith.decode import mirror`` imports draftsmith.decode.mirror (one of
    ``modules``), ``from draftsmith.decode.mirror import X`` draftsmith.decode.mirror.
    ``as_module``: the module's import name, when ``path`` is not under the checkout."""
    module = as_module or module_name(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path.name == "__init__.py")
            for alias in node.names:
                child = f"{source}.{alias.name}"
                # `from draftsmith import files` imports draftsmith.files: a name that is a module counts
                found.append(child if child in modules or source == "draftsmith" else source)
    return [m for m in found if m.startswith("draftsmith.")]


MODULE_STRING = re.compile(r"draftsmith(\.[A-Za-z_]\w*)+(:[\w.]+)?")
"""A string that is a module path (``draftsmith.x.y``, or ``draftsmith.x.y:attr``) and nothing else."""


def named_modules(path: Path, modules: set[str] = MODULES) -> list[str]:
    """The draftsmith modules ``path`` names in string constants (an import by string, a registry
    entry): for each such string, the longest prefix of it that is one of ``modules``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and MODULE_STRING.fullmatch(node.value)
        ):
            parts = node.value.partition(":")[0].split(".")
            prefixes = [".".join(parts[:n]) for n in range(len(parts), 1, -1)]
            found += [p for p in prefixes if p in modules][:1]
    return found


def folder_of(module: str, path: Path) -> str:
    """The package whose folder holds the file (a package's ``__init__`` sits in its own folder)."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def folder_graph(paths: list[Path], as_modules: dict[Path, str] | None = None) -> dict[str, set[str]]:
    """module -> the modules of its own folder it imports (strings left out: a lazy registry is no circle)."""
    names = {p: (as_modules or {}).get(p) or module_name(p) for p in paths}
    folders = {names[p]: folder_of(names[p], p) for p in paths}
    known = MODULES | set(folders)
    graph: dict[str, set[str]] = {}
    for path in paths:
        here = names[path]
        graph[here] = {
            m
            for m in imports(path, here, known)
            if m != here and m in folders and folders[m] == folders[here]
        }
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_higher_layer(path):
    here = layer_of(module_name(path))
    higher = [m for m in imports(path) if layer_of(m) > here]
    assert not higher, f"{module_name(path)} ({LAYERS[here][0]}) imports {higher} from a higher layer"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_names_a_higher_layer_in_a_string(path):
    module = module_name(path)
    here = layer_of(module)
    higher = [
        m for m in named_modules(path) if layer_of(m) > here and (module, m) not in KNOWN_UPWARD_STRINGS
    ]
    assert not higher, (
        f"{module} ({LAYERS[here][0]}) names {higher} of a higher layer in a string (an import by name); "
        "let the higher layer register with the lower one instead"
    )


def test_no_folder_imports_itself_in_a_circle():
    found = circles(folder_graph(SOURCES)) - KNOWN_CIRCLES
    assert not found, (
        f"modules of one folder import each other in a circle: {[sorted(c) for c in found]}; "
        "move what both need into a module below them"
    )


def _write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return path


def test_the_check_fails_on_a_decoder_that_imports_a_draft_kind(tmp_path):
    bad = ROOT / "decode" / "speculative.py"
    source = bad.read_text() + "\n\ndef _f():\n    from draftsmith.drafts.eagle import EagleHead\n"
    (tmp_path / "speculative.py").write_text(source)
    found = imports(tmp_path / "speculative.py", "draftsmith.decode.speculative")
    assert "draftsmith.drafts.eagle" in found and layer_of("draftsmith.drafts.eagle") > layer_of(
        module_name(bad)
    )


def test_the_check_sees_relative_imports(tmp_path):
    source = "def _f():\n    from ..drafts.eagle import EagleHead\n    from .. import drafts\n    from . import mirror\n"
    modules = {"draftsmith.decode.speculative", "draftsmith.decode.mirror", "draftsmith.drafts.eagle"}
    found = imports(_write(tmp_path / "speculative.py", source), "draftsmith.decode.speculative", modules)
    assert found == ["draftsmith.drafts.eagle", "draftsmith.drafts", "draftsmith.decode.mirror"]
    assert layer_of(found[0]) > layer_of("draftsmith.decode.speculative")
    package = imports(
        _write(tmp_path / "__init__.py", "from .eagle import EagleHead\n"), "draftsmith.drafts", modules
    )
    assert package == ["draftsmith.drafts.eagle"]  # a package's `.` is the package itself


def test_the_check_sees_module_names_in_strings(tmp_path):
    source = (
        "import importlib\n"
        'OBJECTIVE = "draftsmith.train.objectives.eagle"\n'
        'CALLBACK = "draftsmith.train.loop:train"\n'
        'NOT_A_MODULE = "draftsmith.train is where the loop lives"\n'
        "def _f():\n"
        '    return importlib.import_module("draftsmith.eval.stats")\n'
    )
    modules = {
        "draftsmith.train",
        "draftsmith.train.objectives.eagle",
        "draftsmith.train.loop",
        "draftsmith.eval.stats",
    }
    found = named_modules(_write(tmp_path / "eagle.py", source), modules)
    assert found == ["draftsmith.train.objectives.eagle", "draftsmith.train.loop", "draftsmith.eval.stats"]
    assert all(layer_of(m) > layer_of("draftsmith.drafts.eagle") for m in found)


def test_the_check_finds_a_circle_through_a_type_only_import(tmp_path):
    files = {
        "a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from draftsmith.decode.b import B\n",
        "b": "from . import c\n",
        "c": "def _f():\n    from draftsmith.decode.a import A\n",
        "d": "from draftsmith.decode.a import A\nfrom draftsmith.drafts.x import X\n",  # no circle: nothing imports d
    }
    paths = {_write(tmp_path / "decode" / f"{n}.py", s): f"draftsmith.decode.{n}" for n, s in files.items()}
    abc = frozenset({"draftsmith.decode.a", "draftsmith.decode.b", "draftsmith.decode.c"})
    assert circles(folder_graph(list(paths), paths)) == {abc}
    del paths[tmp_path / "decode" / "c.py"]
    assert circles(folder_graph(list(paths), paths)) == set()


ENTRY_POINTS = {"draftsmith", "draftsmith.cli"}
"""What a user runs or imports first: the package and pyproject's ``draftsmith = "draftsmith.cli:main"``."""


def test_every_module_serves_the_product():
    """No module of the package exists only for bench/ or the tests: each is imported, or named in a registry
    string, by another module of the package (what only the benches need lives in bench/benchlib/). An
    engine's module is found by its record's name (``export/engines.py``: ``draftsmith.export.<name>``), a
    kind's by its line of the one registry (``drafts/base.KINDS``)."""
    from draftsmith.drafts.base import KINDS
    from draftsmith.drafts.engines import export_engines

    reached = set(ENTRY_POINTS) | {f"draftsmith.export.{engine.name}" for engine in export_engines()}
    for files in KINDS.values():
        reached |= {f"draftsmith.drafts.{files.drafts}"}
        reached |= {f"draftsmith.train.objectives.{files.objective}"} if files.objective else set()
        reached |= {f"draftsmith.export.{files.export}"} if files.export else set()
    for path in SOURCES:
        here = module_name(path)
        reached |= {m for m in imports(path) + named_modules(path) if m != here}
    for module in list(reached):  # importing draftsmith.x.y imports its packages too
        parts = module.split(".")
        reached |= {".".join(parts[:n]) for n in range(1, len(parts))}
    unreached = sorted(MODULES - reached)
    assert not unreached, (
        f"{unreached} are imported by no module of the package (only by bench/ or tests, or by nothing): move "
        "what only the benches need into bench/benchlib/, delete what nothing needs"
    )
