"""Where training metrics go: ``trainer.loggers``, any of csv, tensorboard, wandb and mlflow (Lightning's
loggers). W&B and MLflow are not dependencies of draftsmith: a recipe that lists one where it is not
installed is refused before the target loads, with the command that installs it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")
PACKAGE = {"csv": None, "tensorboard": None, "wandb": "wandb", "mlflow": "mlflow"}
"""The package a logger needs beyond draftsmith's own (TensorBoard's writer comes with Lightning)."""


def check_loggers(names: list[str]) -> None:
    """Raise ``ImportError`` naming the package to install for a listed logger that cannot be imported."""
    for name in names:
        package = PACKAGE[name]
        if package is not None and importlib.util.find_spec(package) is None:
            raise ImportError(
                f"trainer.loggers lists {name}, but {package} is not installed: pip install {package} "
                f"(or drop {name} from trainer.loggers)"
            )


def build_loggers(names: list[str], output_dir: Path) -> list:
    """Lightning loggers writing under ``output_dir``: logs/ (CSV), tensorboard/, mlruns/ (MLflow, unless
    MLFLOW_TRACKING_URI says where), wandb/ (W&B: project WANDB_PROJECT or draftsmith, run named after
    the folder; WANDB_MODE=offline keeps it on disk)."""
    check_loggers(names)
    from lightning.pytorch import loggers

    made = []
    for name in names:
        if name == "csv":
            made.append(loggers.CSVLogger(output_dir, name="logs"))
        elif name == "tensorboard":
            made.append(loggers.TensorBoardLogger(output_dir, name="tensorboard"))
        elif name == "wandb":
            made.append(loggers.WandbLogger(
                name=output_dir.name, save_dir=str(output_dir), project=os.environ.get("WANDB_PROJECT", "draftsmith")
            ))  # fmt: skip
        elif name == "mlflow":
            uri = os.environ.get("MLFLOW_TRACKING_URI") or (output_dir / "mlruns").resolve().as_uri()
            made.append(
                loggers.MLFlowLogger(experiment_name="draftsmith", run_name=output_dir.name, tracking_uri=uri)
            )
    return made


def where(names: list[str], output_dir: Path) -> str:
    """Where each logger writes, for the summary at the end of a run."""
    places = {"csv": f"{output_dir / 'logs'} (CSV)", "tensorboard": f"{output_dir / 'tensorboard'} (TensorBoard)",
              "wandb": "W&B (wandb)", "mlflow": "MLflow (mlflow ui)"}  # fmt: skip
    return ", ".join(places[n] for n in names) or "none (trainer.loggers is empty)"
