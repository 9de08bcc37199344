"""Run progress: a rich progress bar, ``metrics.jsonl`` and TensorBoard scalars (rank 0 only).

Each logged step appends one JSON object to ``<log dir>/metrics.jsonl``
(``step``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``tokens``, ``elapsed_s``,
and ``moe_aux_loss`` for MoE models); the same numbers go to TensorBoard under
``<log dir>/tensorboard`` as ``train/<name>``. A resumed run appends to the same
file, so a step may appear twice (the later line is the resumed run's). On a
terminal a progress bar shows step, loss, lr, tokens/s and ETA; elsewhere (CI, a
log file) one line per logged step is printed instead.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class RunLogger:
    """Where a run's numbers go. Every method is a no-op when ``enabled`` is False (ranks > 0)."""

    def __init__(self, log_dir: Path, *, total_steps: int, start_step: int, enabled: bool = True,
                 tensorboard: bool = True, progress: bool = True) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self._start = time.perf_counter()
        self._metrics = None
        self._writer = None
        self._progress: Progress | None = None
        self._console = Console(stderr=False)
        self._plain = progress and not self._console.is_terminal
        if not enabled:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = (log_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"), purge_step=start_step + 1)
        if progress and self._console.is_terminal:
            self._progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("lr {task.fields[lr]}"),
                TextColumn("{task.fields[tps]} tok/s"), TextColumn("ETA"), TimeRemainingColumn(),
                console=self._console,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step,
                                                 loss="-", lr="-", tps="-")

    def log(self, step: int, values: dict[str, float]) -> None:
        """Record one step's numbers everywhere."""
        if not self.enabled:
            return
        record: dict[str, Any] = {"step": step, **values, "elapsed_s": round(time.perf_counter() - self._start, 3)}
        assert self._metrics is not None
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(f"train/{name}", value, step)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{values['loss']:.4f}",
                                  lr=f"{values['lr']:.2e}", tps=f"{values['tokens_per_s']:,.0f}")
        elif self._plain:
            extra = f" aux {values['moe_aux_loss']:.4f}" if "moe_aux_loss" in values else ""
            print(f"step {step}/{self.total_steps} loss {values['loss']:.4f} lr {values['lr']:.3e} "
                  f"grad_norm {values['grad_norm']:.3f} {values['tokens_per_s']:,.0f} tok/s{extra}", flush=True)

    def advance(self, step: int) -> None:
        """Move the bar on a step that is not logged."""
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def message(self, text: str) -> None:
        """A line for the user (above the bar when there is one)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
