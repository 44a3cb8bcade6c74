"""The published model card: YAML metadata, the measured numbers of an eval report, recipe and usage.

What the draft is (its ``library_name``, its lines after the target's) is its family's (``Family``).

The usage section is generated from the engine records: a section per engine that takes the draft's
kind (the engine's own snippet, ``draftsmith/export/<engine>.py``), and the reasons of those that do not.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from draftsmith import files
from draftsmith.draft_checkpoint import DraftCheckpoint
from draftsmith.drafts.engines import export_engines
from draftsmith.export.engines import CARD_K, CardContext, refusal, usage_of
from draftsmith.hub import HUB_ID, KNOWN_TARGETS, hub_id_of_target
from draftsmith.publish.report import EvalReport


def base_model_of(ckpt: DraftCheckpoint, given: str | None) -> str:
    """The Hub id of the draft's target (``base_model``): --base-model, a known alias, or the recorded Hub id."""
    if given:
        return given
    name = str(ckpt.target.get("name") or "")
    if hub_id_of_target(ckpt.target):
        return hub_id_of_target(ckpt.target)
    raise ValueError(
        f"the draft's target is recorded as {name!r}, which is not a Hub id; pass --base-model ORG/NAME (the "
        "target's id on the Hub, written as base_model in the card)"
    )


def license_of(ckpt: DraftCheckpoint, given: str | None) -> str:
    if given:
        return given
    name = str(ckpt.target.get("name") or "")
    if name in KNOWN_TARGETS:
        return KNOWN_TARGETS[name][1]
    raise ValueError("pass --license (e.g. apache-2.0): a draft usually follows its target's license")


def _local_path(value: str) -> Path | None:
    """``value`` as a local path if it reads as one (absolute, ./ or ../, several parts, or existing)."""
    if not value or "\n" in value or HUB_ID.match(value) and not Path(value).exists():
        return None  # a Hub id (org/name) stays as it is
    path = Path(value)
    if path.is_absolute() or value.startswith(("./", "../")) or len(path.parts) > 2 or path.exists():
        return path
    return None


def portable(value):
    """``value`` (a recipe or report, nested dicts/lists) with every local path replaced by its file name
    and, for a file that is here, the start of its sha256: what was used, not where it lay on this disk."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, str) and (path := _local_path(value)) is not None:
        if path.is_file():
            return f"{path.name} (sha256 {files.file_digest(path)[:12]})"
        return f"{path.name}/" if path.is_dir() else path.name
    return value


def portable_recipe(text: str) -> str:
    """The recipe YAML with local paths replaced (see ``portable``)."""
    recipe = yaml.safe_load(text)
    if not isinstance(recipe, dict):
        return text
    return yaml.safe_dump(portable(recipe), sort_keys=False, allow_unicode=True)


def _fmt(x, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def metrics_section(ev: EvalReport, plot: str | None) -> list[str]:
    """τ, α, speedup and exactness overall and per category, per-position acceptance, settings, hardware."""
    r, d = ev.report, ev.entry
    s = r.get("settings") or {}
    lines = [
        "## Measured speed-up",
        "",
        f"Measured with `draftsmith eval` against **{r['target']}** alone, same prompts, settings and process.",
        "",
        "| category | τ (tokens / target forward) | α (acceptance) | speed-up | output = target's |",
        "|---|---:|---:|---:|---|",
    ]

    def row(cat: str, m: dict) -> str:
        exact = {True: "yes", False: "NO", None: "—"}[m.get("exact_match")]
        return (
            f"| {cat} | {_fmt(m.get('tau'))} | {_fmt(m.get('alpha'))} | {_fmt(m.get('speedup'))}× | {exact} |"
        )

    lines.append(row("**all**", d))
    lines += [
        row(cat, d["categories"][cat]) for cat in r.get("categories") or [] if cat in d.get("categories", {})
    ]
    per_pos = d.get("per_position") or []
    lines += [
        "",
        "Per-position acceptance, P(draft token i accepted | the tokens before it accepted):",
        "",
        "| position | " + " | ".join(str(i + 1) for i in range(len(per_pos))) + " |",
        "|---" * (len(per_pos) + 1) + "|",
        "| P(accept) | " + " | ".join(_fmt(p) for p in per_pos) + " |",
        "",
    ]
    if plot:
        lines += [f"![per-position acceptance and τ by category]({plot})", ""]
    base = r.get("baseline") or {}
    drafting = (
        f"draft trees {s['tree']} (depth, top-k, nodes per step)"
        if s.get("tree")
        else f"k = {s.get('k')} draft tokens per step"
    )
    lines += [
        f"- draft throughput {_fmt(d.get('tokens_per_s'), '.1f')} tok/s vs target alone "
        f"{_fmt(base.get('tokens_per_s'), '.1f')} tok/s ({d.get('new_tokens')} new tokens, "
        f"{d.get('generations')} generations)",
        f"- hardware: {r.get('hardware')}",
        f"- settings: {drafting}, max new tokens = {s.get('max_new_tokens')}, "
        f"temperature = {s.get('temperature')}, top-k = {s.get('top_k')}, top-p = {s.get('top_p')}, "
        f"seed = {s.get('seed')}, dtype = {s.get('dtype')}",
        f"- prompts: `{Path(str(s.get('prompts'))).name}` ({s.get('num_prompts')} prompts, order "
        f"{s.get('order')}; categories: {', '.join(r.get('categories') or [])})",
        "",
    ]
    return lines


def usage_section(ckpt: DraftCheckpoint, repo_id: str, base_model: str) -> list[str]:
    """How to run the draft: with draftsmith, then with each engine that takes its kind (the engine's own
    snippet), then why the others do not."""
    lines = [
        "## How to use",
        "",
        "### draftsmith",
        "",
        "```bash",
        f"draftsmith eval --target {base_model} --draft {repo_id} --prompts prompts.jsonl --out eval/",
        "```",
        "",
    ]
    card = CardContext(ckpt.kind, ckpt.config, repo_id, base_model, CARD_K)
    refused: dict[str, list[str]] = {}
    for engine in export_engines():
        why = refusal(ckpt.kind, engine)
        if why is not None:
            refused.setdefault(why, []).append(engine.title)
        elif (usage := usage_of(ckpt.kind, engine)) is not None:
            lines += usage(card)
    for why, titles in refused.items():
        lines += [f"### {', '.join(titles)}", "", f"Not served there: {why}.", ""]
    return lines


def render_card(
    ckpt: DraftCheckpoint,
    repo_id: str,
    base_model: str,
    license: str,
    datasets: list[str],
    ev: EvalReport | None,
    plot: str | None,
    recipe: str | None,
) -> str:
    """README.md: YAML metadata, then what the draft is, its measured numbers, its recipe and its usage."""
    kind, family = ckpt.kind.title, ckpt.kind.family
    tags = ["speculative-decoding", "draft-model", "draftsmith", ckpt.kind.name]
    meta: dict = {
        "base_model": base_model,
        "library_name": family.library_name,
        "license": license,
        "tags": tags,
        "pipeline_tag": "text-generation",
    }
    if datasets:
        meta["datasets"] = datasets
    name = repo_id.split("/")[-1]
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "", f"# {name}", ""]
    target = ckpt.target
    lines += [
        f"{'An' if kind[0] in 'AEIOU' else 'A'} {kind} for speculative decoding with [{base_model}](https://huggingface.co/{base_model}), "
        "trained with draftsmith. The draft proposes tokens; the target verifies them in one "
        "forward pass, so greedy outputs are the target's own, token for token.",
        "",
        f"- target: `{target.get('name')}` ({target.get('num_hidden_layers')} layers, hidden size "
        f"{target.get('hidden_size')}, vocabulary {target.get('vocab_size')}, tokenizer fingerprint "
        f"`{target.get('tokenizer_fingerprint')}`)",
    ]
    if family.card_lines is not None:
        lines += family.card_lines(ckpt.config)  # what the draft is: its family's lines
    lines.append("")
    lines += metrics_section(ev, plot) if ev else ["## Measured speed-up", "", "Not measured yet.", ""]
    if recipe:
        lines += [
            "## Training recipe",
            "",
            "Local files are named with the first 12 hex digits of their sha256.",
            "",
            "```yaml",
            portable_recipe(recipe).strip(),
            "```",
            "",
        ]
    lines += usage_section(ckpt, repo_id, base_model)
    if ev:
        from draftsmith.eval.report import METRICS

        lines += ["## Metrics", "", "```", METRICS, "```", ""]
    return "\n".join(lines)
