"""``draftsmith publish CKPT --repo-id ORG/NAME``: a self-contained Hub folder with a measured model card.

The folder holds the draft as saved (safetensors weights, config with the draft-vocabulary maps inside
EAGLE heads, tokenizer files of distilled drafts), the recipe it was trained with, the eval report
and its acceptance plot, and README.md. It is pushed in one commit with huggingface_hub, which finds
the token itself (HF_TOKEN, or `hf auth login`); the token is never printed nor written anywhere.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from draftsmith import files
from draftsmith.draft_checkpoint import DraftCheckpoint, locate_checkpoint
from draftsmith.drafts.base import check_saved_draft
from draftsmith.eval.plots import PLOT_NAME
from draftsmith.hub import HUB_ID
from draftsmith.publish.card import base_model_of, license_of, portable, portable_recipe, render_card
from draftsmith.publish.report import find_report

REPORT_NAME = "eval_report.json"
RECIPE_NAME = "train_config.yaml"

DESCRIPTION = """\
Build a self-contained folder for the Hugging Face Hub from a draft checkpoint (a `draftsmith train`
run directory or its draft/ directory) and push it as one commit.

The model card (README.md) carries YAML metadata (base_model = the target, library_name, tags,
license, datasets), the numbers of the latest `draftsmith eval` report of this checkpoint (τ, α,
per-position acceptance, speed-up, per category, hardware, settings, prompt set) and its plot, the
training recipe, and how to load the draft with draftsmith and with each engine that takes its kind
(the engines and their snippets: `draftsmith export --help`).

Which eval report: --report PATH if given; otherwise the newest report.json under the run directory
(e.g. RUN/eval/report.json) whose measured drafts include this checkpoint's draft directory.

The token comes from the usual places (HF_TOKEN, or `hf auth login`); it is never printed or written."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``publish`` subcommand; ``args.func`` runs it."""
    p = subparsers.add_parser(
        "publish",
        help="publish a draft checkpoint to the Hugging Face Hub with a model card of measured numbers",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "checkpoint", metavar="CKPT", help="a `draftsmith train` run directory or its draft/ directory"
    )
    p.add_argument(
        "--repo-id", required=True, metavar="ORG/NAME", help="the Hub model repository (created if missing)"
    )
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument(
        "--revision", metavar="BRANCH", default=None, help="push to this branch (created if missing)"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build the folder and list what would be uploaded; push nothing",
    )
    p.add_argument(
        "--out", metavar="DIR", default=None, help="where to build the folder (default: <run dir>/publish)"
    )
    p.add_argument(
        "--report",
        metavar="PATH",
        default=None,
        help="the eval report.json (or its folder) to put in the card",
    )
    p.add_argument(
        "--no-eval", action="store_true", help="publish without measured numbers when no report exists"
    )
    p.add_argument(
        "--base-model", metavar="ORG/NAME", default=None, help="the target's Hub id (default: from the draft)"
    )
    p.add_argument("--license", default=None, help="license id for the card (default: the known target's)")
    p.add_argument(
        "--datasets", metavar="ID,ID", default=None, help="Hub dataset ids for the card's metadata"
    )
    p.add_argument("--commit-message", default=None, help="default: 'Upload <kind> draft with draftsmith'")
    p.set_defaults(func=run)
    return p


def recipe_datasets(recipe: dict | None) -> list[str]:
    """Hub dataset ids among the recipe's data paths (local files are described in the card, not listed)."""
    paths = ((recipe or {}).get("data") or {}).get("paths") or []
    return [
        p
        for p in paths
        if isinstance(p, str) and HUB_ID.match(p) and not Path(p).suffix and not Path(p).exists()
    ]


def _copy_draft(ckpt: DraftCheckpoint, folder: Path) -> None:
    if not list(ckpt.draft_dir.glob("*.safetensors")):
        raise ValueError(
            f"{ckpt.draft_dir} has no safetensors weights; re-save the draft with save_pretrained"
        )
    for file in sorted(ckpt.draft_dir.iterdir()):
        if file.is_file() and not file.name.startswith("."):
            shutil.copyfile(file, folder / file.name)
    recipe = ckpt.recipe_path()
    if recipe is not None:
        (folder / RECIPE_NAME).write_text(portable_recipe(recipe.read_text()))


def build_folder(
    ckpt: DraftCheckpoint,
    repo_id: str,
    out: Path,
    report: str | None = None,
    no_eval: bool = False,
    base_model: str | None = None,
    license: str | None = None,
    datasets: list[str] | None = None,
) -> Path:
    """Write the folder to publish into ``out`` (replaced whole, atomically); return it."""
    import yaml

    if not HUB_ID.match(repo_id) or "@" in repo_id:
        raise ValueError(f"--repo-id {repo_id!r} is not a Hub repository id (ORG/NAME)")
    base = base_model_of(ckpt, base_model)
    lic = license_of(ckpt, license)
    ev = find_report(ckpt, report)
    if ev is None and not no_eval:
        raise FileNotFoundError(
            f"no eval report measured {ckpt.draft_dir}. Run `draftsmith eval --target ... --draft {ckpt.draft_dir} "
            f"--prompts ... --out {(ckpt.run_dir or ckpt.draft_dir.parent) / 'eval'}` first, pass --report, or "
            "--no-eval to publish without numbers"
        )
    recipe_path = ckpt.recipe_path()
    recipe_text = recipe_path.read_text() if recipe_path else None
    if datasets is None:
        datasets = recipe_datasets(yaml.safe_load(recipe_text) if recipe_text else None)

    _check_out(out, ckpt)

    def fill(tmp: Path) -> None:
        _copy_draft(ckpt, tmp)
        plot = None
        if ev is not None:
            (tmp / REPORT_NAME).write_text(
                json.dumps(published_report(ev, repo_id), indent=2, ensure_ascii=False) + "\n"
            )
            if (ev.path.parent / PLOT_NAME).is_file():
                shutil.copyfile(ev.path.parent / PLOT_NAME, tmp / PLOT_NAME)
            else:
                from draftsmith.eval.plots import plot_report

                plot_report({**ev.report, "drafts": [ev.entry]}, tmp / PLOT_NAME)
            plot = PLOT_NAME
        card = render_card(ckpt, repo_id, base, lic, datasets, ev, plot, recipe_text)
        (tmp / "README.md").write_text(card)
        check_no_token(tmp)

    files.remove_stale(out.parent, out.name)  # what a publish killed while building left beside it
    files.replace_dir(out, fill)
    return out


def published_report(ev, repo_id: str) -> dict:
    """The eval report as published: this draft named by its repo id, local paths as file names."""
    report = dict(ev.report)
    report["settings"] = portable(report.get("settings") or {})
    report["drafts"] = [
        {**d, "name": repo_id} if d is ev.entry else {**d, "name": portable(str(d.get("name")))}
        for d in report.get("drafts") or []
    ]
    return report


def _check_out(out: Path, ckpt: DraftCheckpoint) -> None:
    """Only a previous publish folder may be replaced; never the checkpoint or anything around it."""
    resolved = out.resolve()
    draft = ckpt.draft_dir.resolve()
    if resolved == draft or resolved in draft.parents:
        raise ValueError(f"--out {out} would replace the checkpoint itself; pass a new folder")
    readme = out / "README.md"
    if out.exists() and any(out.iterdir()) and not (readme.is_file() and "draftsmith" in readme.read_text()):
        raise ValueError(f"--out {out} exists and is not a draftsmith publish folder; pass a new folder")


def check_no_token(folder: Path) -> None:
    """Refuse to publish a folder in which the Hugging Face token appears (the token is never shown)."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        return
    needle = token.encode()
    for file in folder.rglob("*"):
        if file.is_file() and needle in file.read_bytes():
            raise ValueError(
                f"{file.name} contains your Hugging Face token; remove it from the checkpoint first"
            )


def upload_files(folder: Path) -> list[Path]:
    """Every file of the folder, relative to it, in upload order."""
    return sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file())


NETWORK_ERRORS = (
    "ConnectError",
    "ConnectTimeout",
    "NetworkError",
    "TransportError",
    "ConnectionError",
    "Timeout",
)
"""Exception class names (anywhere in the class's MRO) of "the host could not be reached": the HTTP
client under huggingface_hub (httpx, httpx2, requests) varies by version, its error names do not."""


def is_network_error(err: BaseException) -> bool:
    return isinstance(err, ConnectionError) or any(
        any(name in cls.__name__ for name in NETWORK_ERRORS) for cls in type(err).__mro__
    )


def push_folder(
    folder: Path, repo_id: str, private: bool = False, revision: str | None = None, message: str | None = None
) -> str:
    """Create the repo (and branch) if needed and upload every file of ``folder`` in one commit; return its URL."""
    from urllib.parse import urlparse

    from huggingface_hub import CommitOperationAdd, HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    if get_token() is None:
        raise ValueError(
            "no Hugging Face token found: run `hf auth login` or set HF_TOKEN, then publish again"
        )
    api = HfApi()
    operations = [
        CommitOperationAdd(path_in_repo=p.as_posix(), path_or_fileobj=str(folder / p))
        for p in upload_files(folder)
    ]
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(
            repo_id,
            operations=operations,
            commit_message=message or "Upload draft with draftsmith",
            revision=revision,
        )
    except Exception as err:  # noqa: BLE001 (every failure of the push becomes one line; none is swallowed)
        first = str(err).splitlines()[0] if str(err) else ""
        if is_network_error(err):
            host = urlparse(api.endpoint).netloc or api.endpoint
            raise ValueError(
                f"could not reach {host} ({type(err).__name__}: {first}); nothing was published. The folder "
                f"{folder} is ready: check the network (or HF_ENDPOINT) and run the same command again."
            ) from None
        if not isinstance(err, (HfHubHTTPError, OSError)):
            raise
        raise ValueError(
            f"could not push to {repo_id} on the Hugging Face Hub ({type(err).__name__}: {first}); nothing was "
            f"published, and the folder {folder} is ready to push again"
        ) from err
    return getattr(info, "commit_url", None) or f"https://huggingface.co/{repo_id}"


def run(args: argparse.Namespace) -> int:
    """Build the folder; list it (--dry-run) or push it."""
    ckpt = locate_checkpoint(args.checkpoint)
    if ckpt.kind.read_for is not None:  # another pipeline's layout
        raise ValueError(
            f"{ckpt.draft_dir} is a {ckpt.kind.title}, with no record of its target or its "
            "measured numbers; read it into draftsmith's layout first (`draftsmith export DIR --to hf --target "
            "MODEL --out NEW`), evaluate that, and publish it"
        )
    problems = check_saved_draft(ckpt.draft_dir)
    if problems:
        raise ValueError(
            f"{ckpt.draft_dir} is not a draft draftsmith trained, so there is nothing to publish: "
            f"{'; '.join(problems)}. Pass a `draftsmith train` run directory or its draft/ directory"
        )
    out = Path(args.out) if args.out else (ckpt.run_dir or ckpt.draft_dir.parent) / "publish"
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()] if args.datasets else None
    folder = build_folder(
        ckpt, args.repo_id, out, args.report, args.no_eval, args.base_model, args.license, datasets
    )
    where = f"{args.repo_id}{' (private)' if args.private else ''}{f' @ {args.revision}' if args.revision else ''}"
    files = upload_files(folder)
    print(f"{'would upload' if args.dry_run else 'uploading'} {len(files)} files from {folder} to {where}:")
    for path in files:
        print(f"  {path}  ({(folder / path).stat().st_size:,} bytes)")
    if args.dry_run:
        return 0
    message = args.commit_message or f"Upload {ckpt.kind.title} ({ckpt.kind.name}) with draftsmith"
    print(f"pushed: {push_folder(folder, args.repo_id, args.private, args.revision, message)}")
    return 0
