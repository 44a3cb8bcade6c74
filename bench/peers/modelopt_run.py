"""NVIDIA ModelOpt 0.47.0's EAGLE-3 training, driven the way its ``examples/speculative_decoding/main.py`` does.

Run by bench/peer_training.py with the modelopt venv's python. That example (and its
``eagle_utils.py``, ``scripts/calibrate_draft_vocab.py``, ``scripts/export_hf_checkpoint.py``) lives in
the NVIDIA/Model-Optimizer repository, not in the wheel, so this is a driver of the wheel's library
written after it: the recipe ``modelopt_recipes/general/speculative_decoding/eagle3.yaml`` loaded with
``modelopt.recipe.load_recipe`` and dotlist overrides, ``HfTrainingArguments`` derived from the
recipe's training schema, ``load_vlm_or_llm`` + ``mtsp.convert(model, [("eagle", cfg)])`` +
``load_draft_vocab_cache``, transformers' ``Trainer``, then ``export_speculative_decoding``. The
target runs in process in every step (ModelOpt's online mode). Where it departs, and why:

- Data: the bench's rendered conversations (draftsmith's chat template and assistant mask) instead of
  ModelOpt's ``LanguageDataCollator`` rendering the raw ones, so every run sees the same tokens; the
  mask goes in as ``loss_mask``, which is what ``answer_only_loss`` would give (the recipe's default,
  false, trains on every token). Rows are padded to ``training_seq_len`` as its collators pad; that
  length is the bench's (512, every conversation fits) instead of 2,048.
- Draft vocabulary: ``calibrate_frequent_vocab``'s rule (the most frequent tokens, all tokens counted,
  ``d2t[i] = id - i``) over the rendered ids of the whole training set, as its calibration script would
  write ``d2t.pt`` from the data file; the bench's size (ModelOpt refuses 32,000 here: too few
  distinct tokens).
- CPU: ``training.use_cpu=true``, ``tf32=false``, ``eagle.eagle_use_torch_compile=false``; the draft
  layer's shape matched to the target (its default config is Llama-3-8B's); one epoch (its default)
  over the bench's conversations, one conversation a step (its default batch). Everything else is the
  recipe's: AdamW lr 1e-4, linear schedule with 1,000 warmup steps, bf16, TTT steps 3.
- One launch-time workaround: ``dataclasses.make_dataclass`` leaves ``HfTrainingArguments`` in module
  ``types``, so saving a checkpoint fails to pickle the arguments; its ``__module__`` is set to this one.
- Held-out: at the end, its model's own loss and per-TTT-step accuracies (what its training logs)
  on the held-out conversations, without updates; the example runs no evaluation by default.
- The head is exported from the trained model in memory rather than reloaded from the saved checkpoint.
- Each batch's real tokens and padded positions are counted (a wrapper around the collator) for the
  steady rate.

``--offline DIR`` (bench/step_like_for_like.py): ModelOpt's offline mode instead, as its example runs it
with ``data.offline_data_path``: the base model loaded without its layers (``load_vlm_or_llm(...,
use_offline_training=True)``), ``eagle_offline`` derived by the recipe, its ``OfflineSupervisedDataset``
(``answer_only_loss``: the stored assistant mask) over ``DIR/train/*.pt`` and ``DIR/heldout/*.pt`` and its
``EagleOfflineDataCollator`` (rows padded to ``training_seq_len``). Each ``.pt`` holds ``input_ids``,
``loss_mask``, ``hidden_states`` (the final state after the norm) and ``aux_hidden_states`` (the three
captured layers concatenated), the keys its ``compute_hidden_states_*`` scripts dump; every step applies
the target's LM head to ``hidden_states`` for its self-distillation targets.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import torch
import transformers
from driver import counted, driver_args, record_steps, write_result
from modelopt.torch.speculative.plugins.hf_training_args import TrainingArguments as SpecTrainingArgs

HfTrainingArguments = dataclasses.make_dataclass(
    "HfTrainingArguments",
    [
        (name, f.annotation, dataclasses.field(default=f.default))
        for name, f in SpecTrainingArgs.model_fields.items()
    ],
    bases=(transformers.TrainingArguments,),
)
HfTrainingArguments.__module__ = __name__  # the pickling workaround (see the module docstring)


class Conversations(torch.utils.data.Dataset):
    """The bench's rendered conversations as ModelOpt's EAGLE model takes them (labels = ids shifted by one)."""

    def __init__(self, path: Path):
        self.rows = [json.loads(line) for line in path.read_text().splitlines() if line]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.rows[i]["input_ids"])
        labels = torch.full_like(ids, -100)
        labels[:-1] = ids[1:]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "loss_mask": torch.tensor(self.rows[i]["loss_mask"]), "labels": labels}  # fmt: skip


def pad_to(length: int):
    """A collator padding (or cutting) every field to ``length`` with zeros, as ModelOpt's collators do."""

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        out = {}
        for key in rows[0]:
            batch = torch.zeros(len(rows), length, dtype=rows[0][key].dtype)
            for b, row in enumerate(rows):
                n = min(length, len(row[key]))
                batch[b, :n] = row[key][:n]
            out[key] = batch
        return out

    return collate


def calibrate(counts: dict[str, int], size: int) -> torch.Tensor:
    """``d2t`` offsets of the ``size`` most frequent tokens (``calibrate_frequent_vocab``'s rule)."""
    vocab = Counter({int(t): n for t, n in counts.items()}).most_common(size)
    if len(vocab) < size:
        raise SystemExit(
            f"only {len(vocab)} distinct tokens in the training data for a {size}-token draft vocabulary"
        )
    return torch.tensor([token - i for i, (token, _) in enumerate(vocab)], dtype=torch.int64)


@torch.no_grad()
def heldout_metrics(model, rows: Conversations, collate) -> dict:
    """The model's own training-time loss and per-TTT-step accuracies on the held-out conversations (no updates)."""
    losses, accs = [], []
    model.train()  # every TTT step runs only in training mode; nothing here is stochastic
    for i in range(len(rows)):
        out = model(**collate([rows[i]]))
        losses.append(float(out.loss))
        accs.append(out.train_acc[0])
    per_step = torch.tensor(accs, dtype=torch.float64).mean(0).tolist()
    return {"loss": sum(losses) / len(losses), **{f"acc_{i}": a for i, a in enumerate(per_step)}}


def check_keys(recipe: dict, keys: list[str]) -> None:
    """Refuse a setting the recipe does not have: ModelOpt's ``load_recipe`` takes a misspelt key silently."""
    for key in keys:
        node = recipe
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise SystemExit(f"--override {key}: ModelOpt's eagle3 recipe has no such key")
            node = node[part]


def split_seed(overrides: list[tuple[str, str]]) -> tuple[int | None, list[tuple[str, str]]]:
    """(``seed=N``'s N or None, the other overrides). The recipe has no seed key: N seeds the draft's
    initialisation (where the example seeds 0) and the Trainer's data order (``TrainingArguments.seed``, 42)."""
    seeds = [int(v) for k, v in overrides if k == "seed"]
    return (seeds[-1] if seeds else None), [(k, v) for k, v in overrides if k != "seed"]


def training_arguments(training: dict, seed: int | None) -> HfTrainingArguments:
    """The recipe's training section as transformers' arguments, with the run's seed when one was given."""
    return HfTrainingArguments(**training, **({} if seed is None else {"seed": seed}))


def main() -> int:
    args, budget = driver_args()
    if args.offline:
        from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset

        train, heldout = (OfflineSupervisedDataset(sorted((args.offline / split).glob("*.pt")), answer_only_loss=True)
                          for split in ("train", "heldout"))  # fmt: skip
    else:
        train = Conversations(args.work / "data" / "train.jsonl")
        heldout = Conversations(args.work / "data" / "heldout.jsonl")
    d2t = args.out / "d2t.pt"
    counts = json.loads((args.work / "data" / "vocab_counts.json").read_text())["all"]
    torch.save(calibrate(counts, budget["draft_vocab_size"]), d2t)

    import modelopt.torch.opt as mto
    import modelopt.torch.speculative as mtsp
    import modelopt_recipes
    from modelopt.recipe import load_recipe
    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.utils import load_vlm_or_llm

    mto.enable_huggingface_checkpointing()
    seed, args.override = split_seed(args.override)
    torch.manual_seed(0 if seed is None else seed)  # the example seeds 0
    target = Path(budget["target_path"])
    shape = json.loads((target / "config.json").read_text())
    recipe_file = Path(modelopt_recipes.__file__).parent / "general" / "speculative_decoding" / "eagle3.yaml"
    theta = shape.get("rope_theta") or shape["rope_parameters"]["rope_theta"]  # transformers 5 nests it
    arch = {"num_hidden_layers": budget["num_layers"], "draft_vocab_size": budget["draft_vocab_size"],
            "rms_norm_eps": shape["rms_norm_eps"], "rope_theta": theta,
            "rope_scaling.rope_type": "default", "rope_scaling.rope_theta": theta}  # fmt: skip
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act"):
        arch[key] = shape.get(key) or shape["hidden_size"] // shape["num_attention_heads"]
    overrides = [f"model.model_name_or_path={target}", f"data.draft_vocab_cache={d2t}",
                 f"data.data_path={args.work / 'data' / 'train.jsonl'}",
                 f"training.output_dir={args.out / 'output'}", "training.use_cpu=true", "training.tf32=false",
                 f"training.training_seq_len={budget['max_length']}", "training.logging_steps=1",
                 "training.report_to=none", "training.dataloader_num_workers=0",
                 f"eagle.eagle_ttt_steps={budget['ttt_steps']}", "eagle.eagle_use_torch_compile=false",
                 *(f"eagle.eagle_architecture_config.{k}={v}" for k, v in arch.items()),
                 *(f"{k}={v}" for k, v in args.override)]  # ModelOpt's own recipe keys, last wins  # fmt: skip
    if args.offline:  # its offline mode (the recipe derives eagle_offline from data.offline_data_path)
        overrides += [f"data.offline_data_path={args.offline / 'train'}", "training.answer_only_loss=true"]
    check_keys(load_recipe(str(recipe_file)).model_dump(), [k for k, _ in args.override])
    recipe = load_recipe(str(recipe_file), overrides=overrides)
    training_args = training_arguments(recipe.training.model_dump(), seed)
    model = load_vlm_or_llm(
        str(target), use_offline_training=bool(args.offline), dtype="auto", device_map="cpu"
    )
    mtsp.convert(model, [("eagle", recipe.eagle.model_dump())])
    mtsp.plugins.HFEagleModel.load_draft_vocab_cache(model, recipe.data.draft_vocab_cache)

    marks = record_steps()
    if args.offline:
        from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator

        collate = EagleOfflineDataCollator(training_args.training_seq_len)
    else:
        collate = pad_to(training_args.training_seq_len)
    step_tokens, step_positions = [], []
    counting = counted(collate, step_tokens, step_positions)
    transformers.Trainer(model=model, args=training_args, train_dataset=train, data_collator=counting).train()
    heldout_record = heldout_metrics(model, heldout, collate)
    head = args.out / "head"
    model.eval()
    with torch.inference_mode():
        export_speculative_decoding(model, export_dir=head)
    write_result(args.out, marks, head, steps=len(marks), heldout=heldout_record, offline=bool(args.offline),
                 step_tokens=step_tokens[: len(marks)], step_positions=step_positions[: len(marks)])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
