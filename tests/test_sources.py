"""Where data comes from: built-in names, Hub datasets through ``datasets.load_dataset`` (tested on local
folders laid out like Hub dataset repositories: parquet shards and the README's ``configs`` metadata),
and a guard that nothing names the data folder beside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftsmith.cli import main
from draftsmith.sources import BUILTIN, DataSourceError, HubSource, builtin_path, check_source, parse_source
from draftsmith.train.corpus.conversations import iter_conversations, load_conversations
from draftsmith.train.corpus.prompts import first_user_turns, source_conversations

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "q{i}"}, {"role": "assistant", "content": "a{i}"}]


def chat(i: int) -> list[dict]:
    return [{k: v.format(i=i) for k, v in turn.items()} for turn in CHAT]


def hub_repo(root: Path, configs: dict[str, dict[str, list[dict]]]) -> Path:
    """A dataset repository as the Hub lays one out: data/<config>/<split>-0000i-of-0000n.parquet (two
    shards a split) and a README whose YAML header maps configs and splits to those files."""
    header = ["---", "configs:"]
    for config, splits in configs.items():
        header += [f"- config_name: {config}", "  data_files:"]
        for split, rows in splits.items():
            folder = root / "data" / config
            folder.mkdir(parents=True, exist_ok=True)
            table = pa.Table.from_pylist(rows)
            half = (len(rows) + 1) // 2
            for i, part in enumerate((table.slice(0, half), table.slice(half))):
                pq.write_table(part, folder / f"{split}-{i:05d}-of-00002.parquet")
            header += [f"  - split: {split}", f"    path: data/{config}/{split}-*"]
    (root / "README.md").write_text("\n".join([*header, "---", "# a test dataset", ""]))
    return root


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """Keep what load_dataset caches inside the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return tmp_path / "hf_cache"


@pytest.fixture
def repo(tmp_path, datasets_cache) -> Path:
    return hub_repo(
        tmp_path / "ultrachat_like",
        {
            "default": {
                "train_sft": [{"prompt_id": str(i), "messages": chat(i)} for i in range(10)],
                "test_sft": [{"prompt_id": str(i), "messages": chat(100 + i)} for i in range(3)],
            },
            "math": {"train": [{"question": f"{i}+{i}?", "answer": f"{2 * i}"} for i in range(4)]},
        },
    )


def test_builtin_names_resolve_inside_the_package():
    for name, relative in BUILTIN.items():
        path = builtin_path(f"builtin:{name}")
        assert path.is_file() and path.relative_to(ROOT / "draftsmith" / "data") == Path(relative)
    assert parse_source("builtin:gsm8k_train") == builtin_path("gsm8k_train")
    with pytest.raises(DataSourceError, match=r"did you mean builtin:sharegpt_1000\?"):
        parse_source("builtin:sharegpt")
    assert (ROOT / "draftsmith" / "data" / "README.md").read_text().count("| `builtin:") == 3


def test_hub_specs_parse_split_config_revision_streaming_and_take():
    assert parse_source("hf:HuggingFaceH4/ultrachat_200k:train_sft") == HubSource(
        "HuggingFaceH4/ultrachat_200k", "train_sft"
    )
    assert parse_source("hf:openai/gsm8k?config=main") == HubSource("openai/gsm8k", "train", config="main")
    spec = "hf:/data/sets/mine:test?revision=v2&streaming=true&take=500"
    assert parse_source(spec) == HubSource("/data/sets/mine", "test", None, "v2", True, 500)
    for bad, says in [
        ("hf:org/set?shuffle=1", "unknown option 'shuffle'"),
        ("hf:org/set?streaming=yes&take=3", "streaming must be true or false"),
        ("hf:org/set?take=0", "take must be a positive number"),
        ("hf:org/set?streaming=true", "add &take=N"),
        ("hf::train", "names no dataset"),
    ]:
        with pytest.raises(DataSourceError, match=says):
            parse_source(bad)


def test_a_hub_dataset_loads_through_load_dataset_with_the_shapes_of_local_files(repo):
    ds = load_conversations([f"hf:{repo}:train_sft"])
    assert ds["messages"] == [chat(i) for i in range(10)]  # both shards, in order
    assert load_conversations([f"hf:{repo}:test_sft"])["messages"] == [chat(100 + i) for i in range(3)]
    math = load_conversations([f"hf:{repo}:train?config=math"])["messages"]
    assert math[1] == [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    assert len(load_conversations([f"hf:{repo}:train_sft?take=4"])) == 4
    streamed = [m for _, m in iter_conversations(f"hf:{repo}:train_sft?streaming=true&take=3")]
    assert streamed == [chat(i) for i in range(3)]
    # the same sources feed `data regenerate` and `data prompts`, named by their spec
    ids = [sid for sid, _ in source_conversations([f"hf:{repo}:test_sft"])]
    assert ids == [f"hf:{repo}:test_sft:{i}" for i in range(3)]
    rows = first_user_turns([f"hf:{repo}:train_sft", "builtin:gsm8k_train"], 4)
    hub = f"hf:{repo}:train_sft"
    assert [r["id"] for r in rows] == [f"{hub}:0", "gsm8k_train.jsonl:0", f"{hub}:1", "gsm8k_train.jsonl:1"]


def test_hub_errors_name_the_dataset_and_what_it_has(repo):
    with pytest.raises(DataSourceError, match=r"train_sft.*test_sft") as err:
        load_conversations([f"hf:{repo}:validation"])  # a split it lacks: the ones it has are listed
    assert f"hf:{repo}:validation" in str(err.value)
    with pytest.raises(DataSourceError, match=r"'default'.*'math'|Available"):
        load_conversations([f"hf:{repo}:train?config=code"])
    odd = hub_repo(repo.parent / "odd", {"default": {"train": [{"text": "x", "label": 1}] * 2}})
    with pytest.raises(DataSourceError, match=r"has columns \['label', 'text'\].*accepted shapes: ShareGPT"):
        load_conversations([f"hf:{odd}"])
    with pytest.raises(DataSourceError, match=r"has columns \['label', 'text'\]"):
        load_conversations([f"hf:{odd}:train?streaming=true&take=1"])


def test_offline_with_no_cached_copy_is_one_clear_error(tmp_path):
    """The real CLI, offline, with an empty cache: one line naming the id, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "draftsmith.cli", "data", "prompts", "--count", "2"]
    cmd += ["--data", "hf:nobody/no_such_set:train", "--out", str(tmp_path / "p.jsonl")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "hf:nobody/no_such_set:train" in lines[0] and "no copy is cached" in lines[0]
    assert not (tmp_path / "p.jsonl").exists()


MEMORY_PROBE = """
import resource, sys
from draftsmith.train.corpus.conversations import iter_conversations
rows = sum(1 for _ in iter_conversations(sys.argv[1]))
print(rows, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.slow
def test_streaming_memory_does_not_grow_with_the_dataset(tmp_path, datasets_cache):
    """take=N of a stream costs the same peak memory from a 4 MB dataset as from one 40 times larger."""

    def rows(n: int) -> list[dict]:  # a distinct 3 kB reply each, so the shards hold every byte
        return [{"messages": [{"role": "user", "content": f"q{i}"},
                              {"role": "assistant", "content": os.urandom(1500).hex()}]}
                for i in range(n)]  # fmt: skip

    small = hub_repo(tmp_path / "small", {"default": {"train": rows(1_000)}})
    large = tmp_path / "large"
    folder = large / "data"
    folder.mkdir(parents=True)
    for i in range(40):  # 40 shards as large as the small set: 120 MB of text
        pq.write_table(pa.Table.from_pylist(rows(1_000)), folder / f"train-{i:05d}-of-00040.parquet")
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size > 100e6

    def peak(repo: Path) -> int:
        spec = f"hf:{repo}:train?streaming=true&take=200"
        env = {**os.environ, "HF_DATASETS_CACHE": str(datasets_cache)}
        out = subprocess.run(
            [sys.executable, "-c", MEMORY_PROBE, spec], capture_output=True, text=True, timeout=300, env=env
        )
        assert out.returncode == 0, out.stderr[-2000:]
        taken, rss = map(int, out.stdout.split())
        assert taken == 200
        return rss

    grown = max(peak(large) for _ in range(2)) - min(peak(small) for _ in range(2))  # each run exits 0
    assert grown < 0.1 * size, f"peak memory grew by {grown / 1e6:.0f} MB for a {size / 1e6:.0f} MB dataset"


def test_a_spec_is_checked_before_a_model_loads(tmp_path):
    check_source("builtin:dev_prompts")
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl does not exist.*builtin:sharegpt_1000"):
        check_source(str(tmp_path / "missing.jsonl"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("draft: {kind: eagle3}\ndata: {paths: [builtin:gsm8k]}\n")
    assert main(["train", str(recipe), f"--output.dir={tmp_path / 'run'}"]) == 2
    assert not (tmp_path / "run").exists()


def test_prompts_for_eval_come_from_a_file_or_the_builtin_set():
    from draftsmith.eval.prompts import load_prompts

    prompts = load_prompts("builtin:dev_prompts", limit=6, order="round-robin")
    assert len({p.category for p in prompts}) == 6
    with pytest.raises(ValueError, match="not a dataset"):
        load_prompts("hf:org/prompts:train")


def test_nothing_shipped_or_tested_names_the_data_folder_beside_the_checkout():
    """The product stands on its own: no code, recipe, test, script or doc of it reads the data folder
    beside the checkout."""
    needle = "/".join(["..", "shared"])
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    history = {"BENCHMARKS.md"}  # past commands, recorded as they were run
    offenders = []
    for name in tracked.stdout.splitlines():
        path = ROOT / name
        if name in history or name.startswith(("bench/results/", "docs/studies/")) or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        offenders += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1) if needle in line]
    assert not offenders, offenders
