"""``draftsmith export --to gguf``: distilled Llama drafts as GGUF, read back by transformers' GGUF loader."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_bpe_target_gguf, tiny_bpe_tokenizer, tiny_model, tiny_target
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith import llamacpp
from draftsmith.cli import main
from draftsmith.decode.target import Target
from draftsmith.drafts import distill
from draftsmith.export import gguf as gguf_export
from draftsmith.export.verify import ExportVerificationError, verify_export
from draftsmith.loading import tokenizer_fingerprint

TEXT = "The quick <|im_start|>brown dog<|im_end|> def add(a, b): return a + b"


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    tokenizer = tiny_bpe_tokenizer()
    target = Target(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, "tiny-bpe")
    draft = distill.from_config(target, 2, 32, seed=0).eval()
    run = tmp_path_factory.mktemp("run")
    return distill.save_draft(draft, tokenizer, target, run / "draft")


def load_back(path):
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def logits(model, ids=((1, 5, 70, 200, 3, 4, 9, 120),)):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


@pytest.mark.parametrize(("dtype", "tol"), [("f32", 1e-6), ("f16", 2e-3), ("bf16", 1e-2), ("q8_0", 2e-2)])
def test_gguf_loads_back_with_the_same_logits_and_tokenizer(draft_dir, tmp_path, dtype, tol):
    original = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(draft_dir)
    path = gguf_export.write_gguf(draft_dir, tmp_path / f"draft-{dtype}.gguf", dtype)
    assert verify_export(path, "gguf")
    model, loaded_tokenizer = load_back(path)
    expected = logits(original)
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=tol * expected.abs().max().item())
    assert loaded_tokenizer(TEXT).input_ids == tokenizer(TEXT).input_ids
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    assert loaded_tokenizer.eos_token == "<|im_end|>"


def test_without_llama_cpp_permutation_the_logits_differ(draft_dir, tmp_path, monkeypatch):
    """The logits check above can fail: q/k written unpermuted are scrambled by the loader's inverse."""
    monkeypatch.setattr(gguf_export, "permute_rows", lambda weight, n_head: weight)
    model, _ = load_back(gguf_export.write_gguf(draft_dir, tmp_path / "raw.gguf", "f32"))
    assert not torch.allclose(
        logits(model), logits(AutoModelForCausalLM.from_pretrained(draft_dir)), atol=1e-4
    )


@pytest.mark.parametrize("how", ["missing", "renamed"])
def test_verifier_refuses_a_gguf_with_a_missing_or_renamed_tensor(draft_dir, tmp_path, monkeypatch, how):
    original = gguf_export.gguf_tensors

    def broken(weights, config):
        tensors = original(weights, config)
        tensor = tensors.pop("blk.1.ffn_up.weight")
        if how == "renamed":
            tensors["blk.1.ffn_upper.weight"] = tensor
        return tensors

    monkeypatch.setattr(gguf_export, "gguf_tensors", broken)
    path = gguf_export.write_gguf(draft_dir, tmp_path / "bad.gguf", "f32")
    with pytest.raises(ExportVerificationError, match="blk.1.ffn_up"):
        verify_export(path, "gguf")


def test_gguf_refuses_other_architectures_and_tokenizers_without_merges(tmp_path):
    qwen = tiny_target("qwen2")
    path = distill.save_draft(
        distill.from_config(qwen, 1, 32, seed=0), qwen.tokenizer, qwen, tmp_path / "qwen"
    )
    with pytest.raises(ValueError, match="Llama-architecture"):
        gguf_export.write_gguf(path, tmp_path / "q.gguf")
    llama = tiny_target("llama")  # tests/tiny.py's byte tokenizer has no merges
    path = distill.save_draft(
        distill.from_config(llama, 1, 32, seed=0), llama.tokenizer, llama, tmp_path / "l"
    )
    with pytest.raises(ValueError, match="no merges"):
        gguf_export.write_gguf(path, tmp_path / "l.gguf")


def test_cli_exports_a_gguf_file_and_verifies_it(draft_dir, tmp_path, capsys):
    assert (
        main(
            [
                "export",
                str(draft_dir.parent),
                "--to",
                "gguf",
                "--gguf-dtype",
                "q8_0",
                "--out",
                str(tmp_path / "g"),
            ]
        )
        == 0
    )
    files = list((tmp_path / "g").glob("*.gguf"))
    assert len(files) == 1 and "q8_0" in files[0].name
    assert "matches what the gguf loader reads" in capsys.readouterr().out


@pytest.mark.slow
def test_smollm2_draft_gguf_carries_the_target_tokenizer(tmp_path):
    """A draft of the real bundled target: tokenizer metadata copied from the target's GGUF, fingerprint kept.

    (Logits through the GGUF loader are checked on the tiny drafts above; this one checks the tokenizer.)"""
    from draftsmith.decode.target import load_target
    from draftsmith.loading import smollm2_gguf_path

    target = load_target("smollm2-135m-instruct", device="cpu")
    draft = distill.from_target_layers(target, [0]).eval()
    path = distill.save_draft(draft, target.tokenizer, target, tmp_path / "draft")
    gguf_file = gguf_export.write_gguf(path, tmp_path / "d.gguf", "q8_0", smollm2_gguf_path())
    assert verify_export(gguf_file, "gguf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_file.name)
    assert tokenizer_fingerprint(tokenizer) == target.fingerprint()


def test_the_pre_tokenizer_and_token_types_are_the_ones_llama_cpp_needs(draft_dir, tmp_path):
    """GPT-2's ByteLevel split is llama.cpp's `gpt-2` (its `default` splits "  #" otherwise), and an added
    special token such as <|im_start|> is CONTROL (USER_DEFINED tokens are printed in generated text)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_export.write_gguf(draft_dir, tmp_path / "d.gguf", "f32")))
    assert reader.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    for special in ("<|im_start|>", "<|im_end|>", "<pad>"):
        assert types[tokens.index(special)] == gguf.TokenType.CONTROL, special
    assert types[tokens.index("Ġthe")] == gguf.TokenType.NORMAL


def test_a_pre_tokenizer_llama_cpp_cannot_be_told_is_refused(tmp_path):
    from tokenizers import pre_tokenizers

    tokenizer = tiny_bpe_tokenizer()
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Punctuation(), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    target = Target(tiny_model("llama", vocab_size=len(tokenizer)), tokenizer, "tiny-bpe")
    path = distill.save_draft(distill.from_config(target, 1, 32, seed=0), tokenizer, target, tmp_path / "d")
    with pytest.raises(ValueError, match="cannot name for llama.cpp.*--target-gguf"):
        gguf_export.write_gguf(path, tmp_path / "d.gguf")
    assert not (tmp_path / "d.gguf").exists()


@pytest.fixture(scope="module")
def bpe_target(tmp_path_factory):
    """The tiny BPE target as a GGUF (an EAGLE-3 head's GGUF copies its target's tokenizer from one)."""
    return tiny_bpe_target_gguf(tmp_path_factory.mktemp("target"))


def eagle3_head(target, directory, capture, draft_vocab):
    from draftsmith.drafts.eagle import EagleConfig, EagleHead
    from draftsmith.drafts.eagle_parts import build_vocab_map

    torch.manual_seed(0)
    config = EagleConfig.for_target(
        target, draft_vocab_size=draft_vocab, capture_layer_ids=capture and sorted(capture)
    )
    if capture:  # in the order given, as earlier versions saved heads (training now wants layer order)
        config.capture_layer_ids = list(capture)
    head = EagleHead(config)
    head.set_vocab_map(*build_vocab_map(torch.rand(target.vocab_size), head.config.draft_vocab_size))
    head.save_pretrained(directory)
    return head


def test_an_eagle3_head_gguf_holds_llama_cpps_eagle3_layout(bpe_target, tmp_path):
    import gguf

    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.export import export_checkpoint

    target, target_gguf = bpe_target
    head = eagle3_head(target, tmp_path / "head", [5, 1, 3], 120)
    path = export_checkpoint(locate_checkpoint(str(tmp_path / "head")), "gguf", tmp_path / "h.gguf", "f32",
                             str(target_gguf))  # fmt: skip
    assert verify_export(path, "gguf")
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "eagle3"
    assert list(reader.fields["eagle3.target_layers"].contents()) == [2, 4, 6]  # ascending, input of layer L
    tensors = {t.name: t for t in reader.tensors}
    assert "token_embd.weight" not in tensors  # llama.cpp embeds with the target's
    fc = torch.from_numpy(tensors["fc.weight"].data.copy())
    blocks = head.fuse_features.weight.detach().split(target.config.hidden_size, dim=1)  # in order 5, 1, 3
    assert torch.equal(fc, torch.cat([blocks[1], blocks[2], blocks[0]], dim=1))  # 1, 3, 5
    assert torch.equal(torch.from_numpy(tensors["d2t"].data.copy()), head.d2t)  # absolute ids
    full = eagle3_head(target, tmp_path / "full", None, target.vocab_size)
    path = export_checkpoint(locate_checkpoint(str(tmp_path / "full")), "gguf", tmp_path / "f.gguf", "f32",
                             str(target_gguf))  # fmt: skip
    assert "d2t" not in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert full.config.draft_vocab_size == target.vocab_size


def test_an_eagle3_gguf_needs_the_gguf_of_its_own_target(bpe_target, tmp_path, capsys):
    from draftsmith.draft_checkpoint import locate_checkpoint
    from draftsmith.export import export_checkpoint

    target, target_gguf = bpe_target
    eagle3_head(target, tmp_path / "head", None, 120)
    ckpt = locate_checkpoint(str(tmp_path / "head"))
    with pytest.raises(ValueError, match="has no GGUF that draftsmith knows.*--target-gguf"):
        export_checkpoint(ckpt, "gguf", tmp_path / "a.gguf")
    other = tmp_path / "other"
    model = tiny_model("llama", vocab_size=len(target.tokenizer), layers=4)
    model.save_pretrained(other)
    target.tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match="not a GGUF of the head's target.*num_hidden_layers 4"):
        export_checkpoint(
            ckpt, "gguf", tmp_path / "b.gguf", "f32", str(gguf_export.write_gguf(other, tmp_path / "o.gguf"))
        )
    assert main(["export", str(tmp_path / "head"), "--to", "gguf", "--out", str(tmp_path / "c.gguf")]) == 2
    assert "--target-gguf" in capsys.readouterr().err
    assert not any(p.suffix == ".gguf" and p.name[0] in "abc" for p in tmp_path.iterdir())


def test_a_missing_build_names_the_command_that_installs_it(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_LLAMACPP", str(tmp_path / "nowhere"))
    assert not llamacpp.available()
    with pytest.raises(FileNotFoundError, match="bash scripts/install_llamacpp.sh"):
        llamacpp.tool("llama-server")


@pytest.mark.parametrize(
    "keep", [10, 1000, 0.5, -10]
)  # in the header, the metadata, the tensors, the last one
def test_a_cut_short_gguf_is_one_line_naming_it_wherever_it_is_read(
    bpe_target, tmp_path, monkeypatch, capsys, keep
):
    import re

    from draftsmith.loading import load_causal_lm

    target, target_gguf = bpe_target
    data = target_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    said = re.escape(f"{cut} is cut short")
    assert main(["export", str(cut), "--to", "gguf", "--verify"]) == 2
    assert re.match("draftsmith export: error: " + said, capsys.readouterr().err)
    eagle3_head(target, tmp_path / "head", None, 120)
    capsys.readouterr()  # save_pretrained's progress bar
    argv = ["export", str(tmp_path / "head"), "--to", "gguf", "--target-gguf", str(cut), "--out", str(tmp_path / "h.gguf")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(said + ".*--target-gguf", err.splitlines()[0])
    assert not (tmp_path / "h.gguf").exists()
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))  # as a target: converted once, if whole
    with pytest.raises(ValueError, match=said):
        load_causal_lm(str(cut), device="cpu")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_an_existing_gguf_file_is_replaced_only_with_overwrite(draft_dir, tmp_path, capsys):
    out = tmp_path / "draft.gguf"
    argv = ["export", str(draft_dir.parent), "--to", "gguf", "--gguf-dtype", "f32", "--out", str(out)]
    assert main(argv) == 0
    earlier = out.read_bytes()
    assert main(argv) == 2
    assert "exists; pass a new path, or --overwrite" in capsys.readouterr().err
    assert out.read_bytes() == earlier
    left = tmp_path / ".draft.gguf.tmp-abc123"  # what a write killed midway leaves
    left.write_bytes(b"GGUF half")
    assert main([*argv, "--overwrite"]) == 0
    assert out.read_bytes()[:4] == b"GGUF" and verify_export(out, "gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft.gguf"]


@pytest.mark.parametrize("theirs", ["not a gguf", "a gguf of the users", "in a folder"])
def test_overwrite_never_replaces_a_gguf_draftsmith_did_not_write(draft_dir, tmp_path, capsys, theirs):
    """Every GGUF the exporter writes carries draftsmith.writer; any other .gguf, a file of the user's, is
    refused naming it, byte for byte kept, in a folder as given as a file."""
    mine = tmp_path / "mine.gguf"
    argv = ["export", str(draft_dir.parent), "--to", "gguf", "--gguf-dtype", "f32", "--overwrite", "--out"]
    assert main([*argv, str(mine)]) == 0
    import gguf

    reader = gguf.GGUFReader(str(mine))
    assert gguf_export.GGUF_WRITER_KEY in reader.fields  # the mark, which a user's GGUF lacks
    if theirs == "not a gguf":
        mine.write_bytes(b"my own file")
    else:  # a whole GGUF of the user's: the same tensors without the mark
        writer = gguf.GGUFWriter(str(mine), "llama")
        writer.add_name("mine")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    if theirs == "in a folder":  # the export's own name in a folder of .gguf files
        folder = tmp_path / "folder"
        folder.mkdir()
        mine = mine.rename(folder / f"{draft_dir.parent.name}-f32.gguf")
    before = mine.read_bytes()
    capsys.readouterr()
    assert main([*argv, str(mine.parent if theirs == "in a folder" else mine)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and f"{mine} is not a GGUF draftsmith wrote" in err, err
    assert mine.read_bytes() == before and sorted(p.name for p in mine.parent.iterdir()) == [mine.name]
