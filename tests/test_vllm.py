"""vLLM as a judge and a data engine: its counters read into draftsmith's record of acceptance, the Medusa
layout it loads, and, where the optional venv exists (``bash scripts/install_vllm.sh``), a real
``vllm serve``: a served draft's acceptance against draftsmith's own, a server of no draft or of another
model refused, and ``data regenerate --engine vllm`` killed with SIGKILL mid-run and resumed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draftsmith import vllm
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.eval.served_acceptance import acceptance_from_counters, read_counters
from draftsmith.export import export_checkpoint
from draftsmith.export.verify import ExportVerificationError, verify_export
from draftsmith.openai_client import CompletionServer, ServerError
from draftsmith.vllm import SpecCounters, parse_spec_counters
from tests.test_served_llamacpp import children
from tests.tiny import tiny_target

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 199.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7962356714710257e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 995.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 41.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="4"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="0"} 1.79e+09
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 1.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 5.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0
"""
"""An excerpt of vLLM 0.32's /metrics after 4 prompts with an EAGLE-3 head (engine 1 added by hand)."""


def test_counters_are_read_from_vllms_metrics_page_summed_over_engines():
    c = parse_spec_counters(METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (200, 1000, 42)
    assert c.accepted_per_position == [31, 8, 2, 1, 0]  # the *_created timestamps are not counts
    assert c.served
    assert not parse_spec_counters("python_gc_objects_collected_total 3.0\n").served


def test_counters_become_the_histogram_of_accepted_lengths():
    # 10 steps of 3 drafts: 6 accepted token 0, 3 of those token 1, 1 all three -> lengths 0,1,2,3 = 4,3,2,1
    stats, exact = acceptance_from_counters(SpecCounters(10, 30, 10, [6, 3, 1]))
    assert exact
    assert dict(stats.steps) == {(3, 0): 4, (3, 1): 3, (3, 2): 2, (3, 3): 1}
    assert stats.tau == pytest.approx(1 + 10 / 10)
    assert stats.per_position == pytest.approx([0.6, 0.5, 1 / 3])
    _, exact = acceptance_from_counters(SpecCounters(10, 25, 10, [6, 3, 1]))  # some steps drafted fewer
    assert not exact
    with pytest.raises(ServerError, match="not decreasing"):
        acceptance_from_counters(SpecCounters(10, 30, 10, [3, 6, 1]))


def test_a_reading_minus_an_earlier_one_is_what_happened_between():
    later, earlier = SpecCounters(12, 60, 9, [6, 3]), SpecCounters(2, 10, 1, [1])
    assert later - earlier == SpecCounters(10, 50, 8, [5, 3])


def metrics_page(c: SpecCounters) -> str:
    """A vLLM /metrics page holding ``c``."""
    lines = [f"vllm:spec_decode_num_{name}_total{{engine=\"0\"}} {getattr(c, name)}.0"
             for name in ("drafts", "draft_tokens", "accepted_tokens")]  # fmt: skip
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}} {n}.0'
              for i, n in enumerate(c.accepted_per_position)]  # fmt: skip
    return "\n".join(lines) + "\n"


class CountingServer:
    """What ``judge_server`` asks of a server, with no server: every request answered with 3 tokens, and
    /metrics reading ``before`` until the first request, ``after`` from then on."""

    url = "http://gpu-7:8000"

    def __init__(self, before: SpecCounters, after: SpecCounters):
        self.pages, self.asked = (metrics_page(before), metrics_page(after)), False

    def metrics(self) -> str:
        return self.pages[self.asked]

    def greedy_ids(self, ids: list[int], max_new_tokens: int) -> list[int]:
        self.asked = True
        return [5, 6, 7]


def judge(before: SpecCounters, after: SpecCounters):
    from draftsmith.eval.prompts import EvalPrompt
    from draftsmith.eval.served_acceptance import judge_server
    from tests.tiny import tiny_tokenizer

    prompts = [EvalPrompt("1", "chat", ("Tell me about cats.", "And dogs?"))]
    return judge_server(CountingServer(before, after), tiny_tokenizer(), prompts, 8)


START = SpecCounters(100, 500, 40, [30, 8, 2, 0, 0])
"""A server's counters before the run: it has drafted before."""


def test_a_served_run_whose_counters_add_up_is_reported():
    run = judge(START, SpecCounters(110, 550, 60, [38, 14, 6, 2, 0]))
    assert run.counters == SpecCounters(10, 50, 20, [8, 6, 4, 2, 0])
    assert run.summary()["tau"] == pytest.approx(3.0) and run.summary()["alpha"] == pytest.approx(0.4)


@pytest.mark.parametrize(
    "after, said",
    [
        (  # the issue's server: tau 9 and alpha 1.6 at k = 5, every position 1.00
            SpecCounters(110, 550, 120, [40, 18, 12, 10, 10]),
            r"vllm:spec_decode_num_accepted_tokens moved by 80, more than the 50 of vllm:spec_decode_num_draft_tokens "
            r"\(an acceptance of 1.60 > 1\)",
        ),
        (
            SpecCounters(110, 600, 110, [40, 18, 12, 10, 10]),
            r"vllm:spec_decode_num_accepted_tokens moved by 70 over 10 vllm:spec_decode_num_drafts, a τ of 8.000 > "
            r"k \+ 1 = 6",
        ),
        (
            SpecCounters(110, 550, 60, [40, 8, 2, 0, 0]),
            r"accepted_tokens_per_pos moved by \[10, 0, 0, 0, 0\], which add up to 10, not the 20 of",
        ),
        (
            SpecCounters(110, 550, 60, [34, 14, 12, 0, 0]),
            r"accepted_tokens_per_pos moved by \[4, 6, 10, 0, 0\] over 10 .*accepted more often than the one before",
        ),
        (SpecCounters(100, 520, 45, [35, 8, 2, 0, 0]), r"vllm:spec_decode_num_drafts did not move, yet"),
        (SpecCounters(12, 60, 5, [4, 1, 0, 0, 0]), r"vllm:spec_decode_num_drafts went down, from 100 to 12"),
    ],
    ids=[
        "acceptance above 1",
        "tau above k+1",
        "positions not the total",
        "a position above the one before",
        "drafts still",
        "a counter went down",
    ],  # fmt: skip
)
def test_served_counters_that_contradict_each_other_are_one_line_naming_the_counter_and_the_server(
    after, said
):
    with pytest.raises(ServerError, match=said) as refused:
        judge(START, after)
    line = str(refused.value)
    assert line.startswith("http://gpu-7:8000's speculative-decoding counters contradict each other")
    assert "\n" not in line and "not reported" in line


def test_a_server_that_drafted_nothing_says_so_instead_of_a_dash():
    with pytest.raises(ServerError) as refused:
        judge(START, START)
    line = str(refused.value)
    assert line.startswith("http://gpu-7:8000 drafted nothing for these prompts: ") and "\n" not in line
    assert "while it generated 6 tokens" in line  # 2 turns of 3


def test_a_missing_or_broken_vllm_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm.ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(FileNotFoundError, match="install_vllm.sh"):
        vllm.version()
    assert not vllm.available()
    monkeypatch.setenv(vllm.ENV, sys.executable)  # draftsmith's own venv, which has no vLLM
    with pytest.raises(RuntimeError, match=r"does not import.*install_vllm.sh"):
        vllm.version()


def make_medusa(target, directory: Path, shared: bool, seed: int = 0):
    from draftsmith.drafts.medusa import MedusaConfig, MedusaHeads

    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig.for_target(target, num_heads=3, num_layers=1, shared_lm_head=shared))
    heads.init_from_target(target.model)
    with torch.no_grad():  # trained-looking blocks: proposals that are not the target's own next token
        for name, param in heads.named_parameters():
            if "heads." in name:
                param.normal_(0, 0.5 / param.shape[-1] ** 0.5)
    heads.save_pretrained(directory)
    return heads


@pytest.mark.parametrize("shared", [False, True])
def test_medusa_exports_to_vllms_layout(tmp_path, shared):
    target = tiny_target("llama", layers=2)
    heads = make_medusa(target, tmp_path / "draft", shared)
    out = export_checkpoint(locate_checkpoint(str(tmp_path / "draft")), "vllm", tmp_path / "vllm")
    verify_export(out, "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["original_lm_head"] is shared
    from safetensors.torch import load_file

    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["blocks.1.layers.0.weight"], heads.heads[1][0].linear.weight)
    assert torch.equal(tensors["blocks.1.layers.0.bias"], heads.heads[1][0].linear.bias)
    assert ("lm_head.weight" in tensors) is shared and ("lm_heads.2.weight" in tensors) is not shared
    assert "norm.weight" not in tensors  # vLLM hands Medusa the state after the target's own final norm

    from safetensors.torch import save_file

    del tensors["blocks.2.layers.0.bias"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ExportVerificationError, match="blocks.2.layers.0.bias"):
        verify_export(out, "vllm")


def test_eagle1_is_refused_for_vllm_naming_its_loader(tmp_path):
    from draftsmith.drafts.base import EAGLE1, draft_kind
    from draftsmith.drafts.engines import VLLM
    from draftsmith.export.engines import refusal

    assert "llama_eagle.py" in refusal(draft_kind(EAGLE1), VLLM)


# --- a real vLLM -------------------------------------------------------------------------------------


def needs_vllm(test):
    """A test of a real vLLM: the ``engine`` tier, skipped where the extra is not installed."""
    skip = pytest.mark.skipif(
        not vllm.available(), reason=f"vLLM is not installed (optional extra: {vllm.INSTALL})"
    )
    return pytest.mark.engine(skip(test))


TARGET = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def real_target():
    from draftsmith.decode.target import load_target

    return load_target(TARGET, device="cpu", dtype="float32")


@contextlib.contextmanager
def served_export(real_target, root, config: dict):
    """(draft folder, server): ``root / "draft"`` exported --to vllm and served with the speculative ``config``."""
    out = export_checkpoint(locate_checkpoint(str(root / "draft")), "vllm", root / "vllm")
    with vllm.Server(
        real_target.model.name_or_path, {**config, "model": str(out)}, log=root / "server.log", kv_cache_gib=1
    ) as server:
        yield root / "draft", server


# Each served fixture is used by one test and scoped to it, so that only one ``vllm serve`` runs at a time:
# held for the module, four servers (and the one a regenerate job starts) outgrew the machine's memory.
@pytest.fixture
def medusa_served(real_target, tmp_path_factory):
    """A real ``vllm serve`` of the bundled target with Medusa heads exported by draftsmith."""
    root = tmp_path_factory.mktemp("vllm")
    make_medusa(real_target, root / "draft", shared=True)
    with served_export(real_target, root, {"method": "medusa", "num_speculative_tokens": 3}) as served:
        yield served


@pytest.fixture(
    params=[{}, {"num_layers": 2, "draft_vocab_size": 8192, "capture_layer_ids": [1, 14, 29]}],
    ids=["1-layer", "2-layer-8k-last-layer"],
)
def dflash_served(real_target, tmp_path_factory, request):
    """A real ``vllm serve`` of the bundled target with a DFlash draft (trained for a minute on the target's
    own answers to the first dev prompts) exported by draftsmith: one layer sharing the target's LM head, and
    two layers with a draft vocabulary of their own (per-layer k_norm, d2t) reading the output of the target's
    last layer (29 of 30), which vLLM captures (drafts/taps.py)."""
    from tests.test_dflash import self_trained_dflash

    root = tmp_path_factory.mktemp("vllm_dflash")
    self_trained_dflash(real_target, root / "draft", **request.param)
    with served_export(real_target, root, {"method": "dflash", "num_speculative_tokens": 7}) as served:
        yield served


PEAGLE_DEPTHS = 6


@pytest.fixture(scope="module")
def peagle_run(real_target, tmp_path_factory):
    """A P-EAGLE head for the bundled target trained for a minute on its own answers to the first dev prompts."""
    from tests.test_dflash import self_trained

    root = tmp_path_factory.mktemp("vllm_peagle")
    self_trained("peagle", real_target, root / "draft", parallel_depths=PEAGLE_DEPTHS, draft_vocab_size=8192)
    return root


@pytest.fixture(params=["vllm", "speculators"])
def peagle_served(real_target, peagle_run, request):
    """vLLM serving that head in parallel, exported --to vllm or --to speculators (vLLM reads the speculators
    type only when the speculator is served as the model, which needs its verifier from the Hub: here the
    method is given, as for the reference layout)."""
    out = export_checkpoint(
        locate_checkpoint(str(peagle_run / "draft")), request.param, peagle_run / request.param
    )
    config = {"method": "eagle3", "parallel_drafting": True, "model": str(out)}
    config["num_speculative_tokens"] = PEAGLE_DEPTHS
    with vllm.Server(
        real_target.model.name_or_path, config, log=peagle_run / f"{request.param}.log", kv_cache_gib=1
    ) as server:
        yield peagle_run / "draft", server


EAGLE31 = {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}


@pytest.fixture
def eagle31_served(real_target, tmp_path_factory):
    """vLLM serving an EAGLE-3 head with the EAGLE-3.1 norms (the shipped recipes' head), trained for a minute on
    the target's own answers to the first dev prompts and exported by draftsmith."""
    from tests.test_dflash import self_trained

    root = tmp_path_factory.mktemp("vllm_eagle31")
    # lr 1e-3: at the fixture's 3e-3 the normed head stalls at the first plateau (walk τ 1.06 against 2.38)
    self_trained(
        "eagle3", real_target, root / "draft", ttt_steps=3, draft_vocab_size=8192, lr=1e-3, **EAGLE31
    )
    with served_export(real_target, root, {"method": "eagle3", "num_speculative_tokens": 3}) as served:
        yield served


@pytest.fixture
def plain_served(real_target, tmp_path_factory):
    with vllm.Server(
        real_target.model.name_or_path, log=tmp_path_factory.mktemp("vllm") / "plain.log"
    ) as server:
        yield server


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftsmith.cli", *argv], capture_output=True, text=True,
                          timeout=900)  # fmt: skip


def served_beside_ours(draft, server, k: int, tmp_path) -> tuple[dict, dict]:
    """(vLLM's acceptance, draftsmith's) of ``draft`` on the first 4 dev prompts, 48 new tokens, k draft tokens:
    one ``draftsmith eval --server`` run."""
    run = cli("eval", "--target", TARGET, "--draft", str(draft), "--server", server.url, "--prompts",
              "builtin:dev_prompts", "--limit", "4", "--max-new-tokens", "48", "--k", str(k),
              "--out", str(tmp_path / "eval"))  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "eval" / "served.json").read_text())
    return record["served"], next(iter(record["draftsmith"].values()))


@pytest.mark.slow
@needs_vllm
def test_served_medusa_is_accepted_as_in_draftsmiths_decoder(medusa_served, tmp_path):
    draft, server = medusa_served
    run = cli("eval", "--target", TARGET, "--draft", str(draft), "--server", server.url, "--prompts",
              "builtin:dev_prompts", "--order", "round-robin", "--limit", "3", "--max-new-tokens", "48", "--k", "3",
              "--out", str(tmp_path / "eval"))  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "eval" / "served.json").read_text())
    served, ours = record["served"], next(iter(record["draftsmith"].values()))
    assert served["verify_steps_with_drafts"] > 10
    assert len(served["per_position"]) == 3 and served["per_position_exact"]
    assert served["tau"] > 1.0  # the blocks are random, yet head 0 agrees with the target now and then
    assert served["tau"] == pytest.approx(ours["tau_drafting"], abs=0.03)
    assert "served:" in run.stdout and "draftsmith:" in run.stdout


@pytest.mark.slow
@needs_vllm
def test_served_dflash_is_accepted_as_in_draftsmiths_decoder(dflash_served, tmp_path):
    served, ours = served_beside_ours(*dflash_served, 7, tmp_path)
    assert served["verify_steps_with_drafts"] > 10 and len(served["per_position"]) == 7
    # A minute of training leaves a DFlash draft on this target at its first plateau (one likely token at
    # every slot: BENCHMARKS.md, "Block drafters"), yet some of its drafts are accepted, by both engines alike;
    # bench/block_drafters.py holds trained drafts (1 and 2 layers, blocks 8 and 16) to the same equality.
    assert served["tau"] > 1.0 and served["per_position"][0] > 0
    assert served["tau"] == pytest.approx(ours["tau_drafting"], abs=0.03)
    for theirs, mine in zip(served["per_position"], ours["per_position"]):
        assert (theirs is None) == (mine is None) and (
            theirs is None or theirs == pytest.approx(mine, abs=0.03)
        )


@pytest.mark.slow
@needs_vllm
def test_served_peagle_drafts_in_parallel_as_draftsmiths_decoder_does(peagle_served, tmp_path):
    draft, server = peagle_served
    run = cli("eval", "--target", TARGET, "--draft", str(draft), "--server", server.url, "--prompts",
              "builtin:dev_prompts", "--limit", "4", "--max-new-tokens", "48", "--k", str(PEAGLE_DEPTHS),
              "--out", str(tmp_path / "eval"))  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "eval" / "served.json").read_text())
    served, ours = record["served"], next(iter(record["draftsmith"].values()))
    assert served["verify_steps_with_drafts"] > 10 and len(served["per_position"]) == PEAGLE_DEPTHS
    assert served["tau"] > 1.2  # trained on these very answers
    assert served["per_position"][1] > 0  # a slot drafted in parallel, not only the real pair, was accepted
    assert served["tau"] == pytest.approx(ours["tau_drafting"], abs=0.03)


@pytest.mark.slow
@needs_vllm
def test_served_eagle31_head_is_accepted_as_in_draftsmiths_decoder(eagle31_served, tmp_path):
    """The EAGLE-3.1 norms mean in vLLM what they mean in draftsmith: the same acceptance, position by position
    (an export that dropped norm_output or read the fused feature without input_norm would draft other tokens)."""
    served, ours = served_beside_ours(*eagle31_served, 3, tmp_path)
    assert served["verify_steps_with_drafts"] > 10 and len(served["per_position"]) == 3
    assert ours["tau_drafting"] > 1.3  # trained on these very answers: the later steps are accepted too
    assert served["tau"] == pytest.approx(ours["tau_drafting"], abs=0.03)
    for theirs, mine in zip(served["per_position"], ours["per_position"]):
        assert theirs == pytest.approx(mine, abs=0.03)


@pytest.mark.slow
@needs_vllm
def test_a_server_of_no_draft_or_of_another_model_is_refused(plain_served, tmp_path):
    from draftsmith.loading import target_tokenizer
    from draftsmith.openai_client import check_server

    client = CompletionServer(plain_served.url)
    tokenizer, config, _ = target_tokenizer(TARGET)
    learned = check_server(client, tokenizer, config.vocab_size)  # vLLM's /v1/models and /tokenize fields
    assert learned["context"] == plain_served.max_model_len
    with pytest.raises(ServerError, match="serves no draft"):
        read_counters(client)
    run = cli("eval", "--target", TARGET, "--server", plain_served.url, "--prompts", "builtin:dev_prompts",
              "--limit", "1", "--out", str(tmp_path / "eval"))  # fmt: skip
    assert run.returncode != 0 and "serves no draft" in run.stderr
    from tests.tiny import tiny_bpe_tokenizer

    with pytest.raises(ServerError, match="tokenizes differently"):
        check_server(CompletionServer(plain_served.url), tiny_bpe_tokenizer(), config.vocab_size)


def descendants(pid: int) -> list[int]:
    found = children(pid)
    return found + [d for c in found for d in descendants(c)]


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "gone"


@pytest.mark.slow
@needs_vllm
def test_regenerate_engine_vllm_killed_mid_run_resumes_every_row_once_in_order(tmp_path):
    from draftsmith.sources import BUILTIN_TRAIN
    from draftsmith.train.corpus.prompts import first_user_turns

    count = 16
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in first_user_turns(list(BUILTIN_TRAIN), count)))
    out = tmp_path / "regenerated.jsonl"
    cmd = [sys.executable, "-m", "draftsmith.cli", "data", "regenerate", "--engine", "vllm", "--target", TARGET,
           "--data", str(prompts), "--out", str(out), "--max-new-tokens", "48", "--batch-size", "2",
           "--dtype", "float32"]  # fmt: skip
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and job.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 3:
            break
        time.sleep(0.1)
    if job.poll() is not None:
        err = job.stderr.read().decode()
        causes = [line for line in err.splitlines() if "Error" in line or "Killed" in line]
        pytest.fail(f"the job ended before it could be killed: {causes[:6]}\n{err[-2000:]}")
    servers = descendants(job.pid)
    assert len(servers) >= 3, (
        "vLLM (its supervisor, API server, engine core and worker) should run under the job"
    )
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    for _ in range(300):  # the supervisor ends vLLM's session: SIGTERM, then SIGKILL after 10 s
        if not any(Path(f"/proc/{pid}").exists() and "zombie" not in state(pid) for pid in servers):
            break
        time.sleep(0.1)
    left = [pid for pid in servers if Path(f"/proc/{pid}").exists() and "zombie" not in state(pid)]
    assert not left, f"vLLM's processes {left} outlived the killed job"
    lines = out.read_text().splitlines(keepends=True)
    done = [json.loads(x) for x in lines if x.endswith("\n")]
    assert 3 <= len(done) < count
    finished = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["source_id"] for r in written] == [f"prompts.jsonl:{i}" for i in range(count)]
    assert written[0]["generator"]["engine"] == "vLLM"


@pytest.mark.slow
@needs_vllm
def test_an_export_vllm_cannot_load_shows_vllms_error_and_the_exports_path(real_target, tmp_path):
    make_medusa(real_target, tmp_path / "draft", shared=True)
    out = export_checkpoint(locate_checkpoint(str(tmp_path / "draft")), "vllm", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    config["hidden_size"] = 64  # vLLM builds 64-wide blocks, the file holds 576-wide ones
    (out / "config.json").write_text(json.dumps(config))
    spec = {"method": "medusa", "model": str(out), "num_speculative_tokens": 3}
    with pytest.raises(RuntimeError) as err:
        with vllm.Server(
            real_target.model.name_or_path, spec, log=tmp_path / "server.log", start_timeout=300
        ):
            pass
    message = str(err.value)
    assert str(out) in message and "could not serve" in message
    assert "Error" in message  # vLLM's own last words, from its log
