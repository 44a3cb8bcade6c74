"""Every published figure traceable: each result under bench/results records its provenance (or is one of
the closed list made before the rule), and README's headline figures are read from the results they cite
or marked as not reproducible from a committed result."""

import json
import re
import statistics
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
UNTRACEABLE = "not reproducible from a committed result"


def problems(record: dict) -> list[str]:
    """What a result lacks of its provenance: the command, the git commit, the machine (CPU model and its
    matrix-instruction flags), the date and the seed (present, ``None`` for a run that draws nothing)."""
    p = record.get("provenance") or {}
    machine = p.get("machine") or {}
    lacks = [key for key in ("commit", "command") if not p.get(key)]
    if not (machine.get("cpu") and "flags" in machine):
        lacks.append("machine")
    if not p.get("date"):
        lacks.append("date")
    if "seed" not in p:
        lacks.append("seed")
    return lacks


def legacy_table() -> dict[str, list[str]]:
    """bench/results/README.md's list of results made before provenance was recorded: file -> what it lacks."""
    text = (RESULTS / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+\.json)` \| ([a-z, ]+) \|$", text, flags=re.M)
    return {name: [x.strip() for x in lacks.split(",")] for name, lacks in rows}


# Closed: the results made before 2026-12-03 without full provenance. A new result records it or fails.
LEGACY = frozenset({
    "batched.json", "cost_model_k.json",
    "cost_model_k_run5.json", "cost_model_k_run6.json", "cost_model_k_run7.json", "cost_model_k_stock_run4.json",
    "cpu_bf16.json", "cpu_kernels.json", "distill_sweep.json", "gpu_eagle3_probe.json", "gpu_eagle3_train.json",
    "heldout_tau.json", "heldout_tau_decode.json", "heldout_tau_distill.json", "heldout_tau_gpu_head.json",
    "heldout_tau_stage4.json", "heldout_tau_stage5.json", "hub_streaming_memory.json", "llamacpp_engine.json",
    "llamacpp_engine_hour.json", "peer_training_100k_offline.json", "peer_training_16k.json",
    "peer_training_400k.json", "peers.json", "regenerate_engines.json", "regenerate_engines_bf16.json",
    "regenerate_throughput.json", "regenerate_vllm.json", "train_throughput.json",
    "train_throughput_cpu_amx_bf16.json", "train_throughput_cpu_amx_fp32.json", "train_throughput_h200.json",
    "vllm_engine.json",
})  # fmt: skip


def committed_results() -> list[Path]:
    try:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "bench/results/*.json"],
                                capture_output=True, text=True, timeout=30, check=True).stdout.split()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout: the committed results cannot be listed")
    return [ROOT / name for name in listed]


def test_every_committed_result_records_its_provenance_or_is_a_listed_older_one():
    table = legacy_table()
    assert set(table) == LEGACY, "bench/results/README.md's list and the test's differ"
    for path in committed_results():
        lacks = problems(json.loads(path.read_text()))
        if path.name in LEGACY:
            assert lacks == table[path.name], (
                f"{path.name}: the list says it lacks {table[path.name]}, it lacks {lacks}"
            )
        else:
            assert not lacks, (
                f"{path.name} lacks {', '.join(lacks)} in its provenance (draftsmith.eval.report.provenance)"
            )


def test_a_result_without_a_commit_or_a_machine_is_rejected():
    from benchlib.records import provenance

    good = {"provenance": provenance(seed=0)}
    if good["provenance"]["commit"] is None:
        pytest.skip("not a git checkout")
    assert problems(good) == []
    no_commit = {"provenance": {**good["provenance"], "commit": None}}
    no_machine = {"provenance": {k: v for k, v in good["provenance"].items() if k != "machine"}}
    no_seed = {"provenance": {k: v for k, v in good["provenance"].items() if k != "seed"}}
    assert problems(no_commit) == ["commit"]
    assert problems(no_machine) == ["machine"]
    assert problems(no_seed) == ["seed"]
    assert problems({"date": "2026-12-03", "hardware": "CPU"}) == [
        "commit",
        "command",
        "machine",
        "date",
        "seed",
    ]


def at(record, *keys):
    for key in keys:
        record = record[key]
    return record


def amx_bf16_over_fp32() -> float:
    def rate(name):
        record = json.loads((RESULTS / f"train_throughput_cpu_amx_{name}.json").read_text())
        return at(record, "runs", "eagle3 online", "tokens_per_s_per_device")

    return rate("bf16") / rate("fp32")


# README's headline figures: the figure as README writes it -> (the result it is read from, how to read it,
# the decimals README rounds to)
CITED = {
    "2.7x": (amx_bf16_over_fp32, 1),
    "τ of 2.39": (
        lambda: at(
            json.loads((RESULTS / "heldout_tau_gpu_head.json").read_text()),
            "drafts",
            "runs/gpu_eagle3/draft",
            "walk",
            "tau",
        ),
        2,
    ),  # fmt: skip
    # the EAGLE-3 default's held-out τ at 0.4M tokens, the mean over its seeds
    "τ 2.23": (
        lambda: statistics.fmean(
            json.loads((RESULTS / "eagle3_recipe.json").read_text())["summary"][0]["heldout_tau"]
        ),
        2,
    ),
    # its dev τ on 96 dev prompts, the mean over the same seeds (one interleaved draftsmith eval)
    "τ 1.40": (
        lambda: statistics.fmean(
            json.loads((RESULTS / "eagle3_recipe.json").read_text())["summary"][0]["dev_tau"]
        ),
        2,
    ),
}
FIGURE = re.compile(r"τ(?: of| =)? \d+\.\d+|\d+(?:\.\d+)?\s?[×x](?=[\s,.;)])")


def sentences(text: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+(?=[A-Z(`])", " ".join(text.split()))


def readme_problems(text: str) -> list[str]:
    """Each headline figure of ``text`` that differs from the result it is read from, or that has no result
    and does not say so in its own sentence; and each figure this test reads that the text no longer has."""
    found, wrong = [], []
    for sentence in sentences(text):
        for figure in FIGURE.findall(sentence):
            found.append(figure)
            if figure in CITED:
                read, decimals = CITED[figure]
                number = float(re.search(r"\d+(?:\.\d+)?", figure).group())
                if round(read(), decimals) != number:
                    wrong.append(f"README says {figure}, its result gives {read():.4f}")
            elif UNTRACEABLE not in sentence:
                wrong.append(f"{figure!r} cites no result: {sentence[:200]}")
    return wrong + [f"{figure!r} is no longer in README" for figure in CITED if figure not in found]


def test_readmes_headline_figures_are_read_from_the_results_they_cite_or_marked():
    assert readme_problems((ROOT / "README.md").read_text()) == []


def test_a_changed_or_unsourced_figure_is_caught():
    text = (ROOT / "README.md").read_text()
    assert any("2.8x" in p for p in readme_problems(text.replace("2.7x", "2.8x")))
    unsourced = text + "\nThe new head reaches 1.52× the target alone.\n"
    assert any("1.52×" in p for p in readme_problems(unsourced))
    assert any("2.03" in p for p in readme_problems(text.replace(UNTRACEABLE, "reproducible")))


def test_ci_runs_the_readme_test_command_with_both_engines():
    """CI (``.ci/run``) runs README's test command verbatim, and that command installs the llama.cpp and vLLM
    extras before pytest, so the engine tests run in CI instead of skipping."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^# the tests.*\n(.+)$", readme, flags=re.M).group(1)
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
    steps = command.split(" && ")
    assert steps[0] == "bash scripts/setup.sh" and steps[-1].startswith(".venv/bin/python -m pytest")
    assert {"bash scripts/install_llamacpp.sh", "bash scripts/install_vllm.sh"} <= set(steps[1:-1])


# --- BENCHMARKS.md's headline tables, cell by cell against the results they cite --------------------------


def section_table(text: str, heading: str, after: str = "") -> list[list[str]]:
    """The cells of the first table after ``after`` in the section whose heading starts with ``heading``
    (bold marks and backticks kept; the header and rule rows dropped)."""
    start = text.index(f"## {heading}")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end > 0 else None]
    lines = section[section.index(after) :].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def plain(cell: str) -> str:
    return cell.replace("**", "").strip()


def spread(values: list[float], decimals: int = 3) -> str:
    return f"{statistics.fmean(values):.{decimals}f} ± {statistics.stdev(values):.{decimals}f}"


def plain_decoding_cells(text: str) -> list[str]:
    """The plain-decoding table against ``plain_decoding_epyc.json``: tok/s, vs generate, of its ceiling and
    outputs equal, per decoder (the row label's first words name the decoder)."""
    record = json.loads((RESULTS / "plain_decoding_epyc.json").read_text())
    labels = {
        "draftsmith, `--cpu-kernels auto`": "draftsmith, auto kernels",
        "draftsmith, packed": "draftsmith, packed",
        "draftsmith, stock": "draftsmith, stock",
        "transformers `generate` (dynamic cache)": "transformers generate",
        "transformers `generate`, static cache": "transformers generate, static cache",
        "llama.cpp, F32": "llama.cpp F32",
        "llama.cpp, Q4_1": "llama.cpp Q4_1",
        "vLLM CPU": "vLLM CPU, batch 1",
    }
    wrong, seen = [], set()
    prompts = record["settings"]["prompts"]
    for cells in section_table(text, "Plain decoding against"):
        key = next((labels[label] for label in labels if cells[0].startswith(label)), None)
        if key is None:
            wrong.append(f"plain decoding: row {cells[0]!r} names no decoder of the result")
            continue
        seen.add(key)
        row = record["rows"][key]
        want = [f"{row['tokens_per_s']:.1f}", f"{row['vs_generate']:.2f}", f"{row['of_ceiling']:.2f}",
                f"{row['same_as_first']}/{prompts}"]  # fmt: skip
        got = [plain(c).split()[0] for c in cells[1:5]]
        if got != want:
            wrong.append(f"plain decoding, {key}: BENCHMARKS says {got}, the result gives {want}")
    return wrong + [f"plain decoding: {key} is not in the table" for key in set(labels.values()) - seen]


def budget_label(tokens: int) -> str:
    """How BENCHMARKS names a token budget in a table's heading: 409,600 -> "0.4M"."""
    return f"{tokens / 1e6:.1f}M"


def seeds_cell(values: list[float]) -> str:
    """mean ± sd (n) over seeds, or the one seed's figure (n=1)."""
    return f"{spread(values)} (n={len(values)})" if len(values) > 1 else f"{values[0]:.3f} (n=1)"


def eagle3_recipe_cells(text: str) -> list[str]:
    """The EAGLE-3 deciding tables, one per token budget ("Deciding table at 0.4M tokens", "... at 1.6M tokens"),
    against ``eagle3_recipe.json``'s summary rows of that budget: held-out τ mean ± sd (n) and dev τ mean ± sd
    (n; per seed) per pipeline point, the point named by its settings in backticks."""
    summary = json.loads((RESULTS / "eagle3_recipe.json").read_text())["summary"]
    wrong, seen = [], set()
    start = text.index("## The EAGLE-3 recipe")
    section = text[start : text.find("\n## ", start + 1)]
    for tokens in sorted({r["tokens"] for r in summary}):
        label, rows = budget_label(tokens), [r for r in summary if r["tokens"] == tokens]
        heading = f"Deciding table at {label} tokens"
        if heading not in section:
            wrong.append(f"EAGLE-3 recipe: no table headed {heading!r}")
            continue
        for cells in section_table(text, "The EAGLE-3 recipe", after=heading):
            setting = " ".join(re.findall(r"`([^`]*)`", cells[0]))
            row = next((r for r in rows if " ".join(r["setting"]) == setting), None)
            if row is None:
                wrong.append(f"EAGLE-3 recipe at {label}: row {cells[0][:60]!r} is no point of the result")
                continue
            seen.add((tokens, setting))
            heldout = seeds_cell(row["heldout_tau"])
            if plain(cells[1]) != heldout:
                wrong.append(f"EAGLE-3 recipe at {label}, {setting}: held-out {plain(cells[1])!r}, the result "
                             f"gives {heldout!r}")  # fmt: skip
            if row["dev_tau"]:
                dev = row["dev_tau"]
                want = f"{spread(dev) if len(dev) > 1 else f'{dev[0]:.3f}'} (n={len(dev)}; {', '.join(f'{t:.3f}' for t in dev)})"
                if plain(cells[2]) != want:
                    wrong.append(f"EAGLE-3 recipe at {label}, {setting}: dev {plain(cells[2])!r}, the result "
                                 f"gives {want!r}")  # fmt: skip
    return wrong + [
        f"EAGLE-3 recipe at {budget_label(r['tokens'])}: {' '.join(r['setting'])} is not in the table"
        for r in summary
        if (r["tokens"], " ".join(r["setting"])) not in seen
    ]


def block_recipe_cells(text: str) -> list[str]:
    """The block drafters' deciding table against ``block_recipe.json``'s summary: held-out τ mean ± sd (n), or
    the one seed's τ (n=1), dev τ and vLLM's acceptance length where a dev run served it, per draft, the draft
    named by its setting in backticks."""
    summary = json.loads((RESULTS / "block_recipe.json").read_text())["summary"]
    wrong, seen = [], set()
    for cells in section_table(text, "Block drafters", after="Deciding table"):
        setting = " ".join(re.findall(r"`([^`]*)`", cells[0]))
        row = next((r for r in summary if r["setting"] == setting), None)
        if row is None:
            wrong.append(f"block drafters: row {cells[0][:60]!r} is no draft of the result")
            continue
        seen.add(setting)
        heldout = seeds_cell(row["heldout_tau"])
        if plain(cells[2]) != heldout:
            wrong.append(
                f"block drafters, {setting}: held-out {plain(cells[2])!r}, the result gives {heldout!r}"
            )
        dev = f"{row['dev_tau'][0]:.3f}" if row["dev_tau"] else "–"
        if plain(cells[3]) != dev:
            wrong.append(f"block drafters, {setting}: dev {plain(cells[3])!r}, the result gives {dev!r}")
        served = (row.get("dev") or {}).get("vllm_tau")
        vllm = "–" if served is None else f"{served:.3f}"
        if len(cells) > 8 and plain(cells[8]) != vllm:
            wrong.append(f"block drafters, {setting}: vLLM {plain(cells[8])!r}, the result gives {vllm!r}")
    return wrong + [
        f"block drafters: {r['setting']} is not in the table" for r in summary if r["setting"] not in seen
    ]


def benchmarks_problems(text: str) -> list[str]:
    return plain_decoding_cells(text) + eagle3_recipe_cells(text) + block_recipe_cells(text)


def test_benchmarks_headline_tables_are_read_from_the_results_they_cite():
    assert benchmarks_problems((ROOT / "BENCHMARKS.md").read_text()) == []


def test_a_changed_cell_of_a_headline_table_is_caught():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert any(
        "llama.cpp F32" in p for p in benchmarks_problems(text.replace("| **41.1** |", "| **41.4** |"))
    )
    assert any(
        "held-out" in p for p in benchmarks_problems(text.replace("**2.226 ± 0.022**", "**2.236 ± 0.022**"))
    )
    assert any("dev" in p for p in benchmarks_problems(text.replace("1.355 ± 0.006", "1.356 ± 0.006")))
    assert any(
        "no table headed" in p
        for p in benchmarks_problems(
            text.replace("Deciding table at 0.4M tokens. Held", "At 0.4M tokens. Held")
        )
    )
    block = text.replace("| 1.627 ± 0.005 (n=3) |", "| 1.637 ± 0.005 (n=3) |")
    assert any("block drafters, dflash-L1-b8-a512: held-out" in p for p in benchmarks_problems(block))
    assert any(
        "not in the table" in p for p in benchmarks_problems(text.replace("`speculators (DFlash)`", ""))
    )
