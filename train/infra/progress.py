"""One progress bar over optimizer steps, the unit a run is sized in (``trainer.max_steps``).

Lightning's own bars count batches per epoch; a run here has no epochs to speak of (``max_epochs=-1``,
the sampler restarts the data as often as needed), so they read "Epoch 49/-2 ... 48/24".
"""

from __future__ import annotations

import lightning as L
from tqdm.auto import tqdm


class StepProgress(L.Callback):
    """``train  37/200 steps [01:12<05:01, loss=2.31, val τ=1.43]``: a resumed run starts at its step."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def on_train_start(self, trainer, module) -> None:
        if trainer.is_global_zero:
            self.bar = tqdm(total=trainer.max_steps, initial=trainer.global_step, desc="train", unit="step",
                            dynamic_ncols=True)  # fmt: skip

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.bar is None:
            return
        self.bar.update(trainer.global_step - self.bar.n)
        metrics = trainer.progress_bar_metrics
        shown = {k.split("/")[-1].replace("tau", "val τ"): f"{v:.3g}" for k, v in metrics.items() if k in
                 ("train/loss", "val/tau")}  # fmt: skip
        if shown:
            self.bar.set_postfix(shown, refresh=False)

    def on_train_end(self, trainer, module) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_exception(self, trainer, module, exception) -> None:
        self.on_train_end(trainer, module)  # closed before the error's line is printed, not after it
