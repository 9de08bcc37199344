"""Robot data-pipeline benchmark: samples/s the pipeline produces vs what a training step consumes.

``trainer vla`` draws its micro-batches in the training process, between steps
(``trainer/data/robot.py``: frames are binned once, a batch gathers rows). This
measures, for each recipe given:

- tokenise: building ``RobotSamples`` (binning every frame) — paid once per run;
- pipeline: samples per second from ``RobotBatches`` (shuffled indices, chunk gather,
  state-noise re-binning when the recipe asks for it, the loop's tensors), one thread,
  as the loop draws them;
- train step: samples per second one optimizer step of the recipe's model consumes
  (forward, backward, AdamW; megatron-core on this host), after warm-up steps;

and prints the ratio (target ≥ 5×) and the share of a step's time the data take.

    .venv/bin/python bench/data_pipeline.py [--dataset DIR] [--recipes configs/vla-reach-fast.yaml,...]

Each recipe runs on its own ``data.path`` when that dataset exists, else on a
50-episode MetaWorld reach dataset collected into a temporary directory first (a
few seconds); ``--dataset`` puts every recipe on one dataset.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import load_config  # noqa: E402
from trainer.data.lerobot import DemonstrationDataset  # noqa: E402
from trainer.data.robot import RobotBatches, RobotSamples, dataset_card  # noqa: E402
from trainer.vla import VLAConfig, resolve_model  # noqa: E402

DEFAULT_RECIPES = "configs/vla-reach-fast.yaml,configs/vla-mt10.yaml"


@dataclasses.dataclass
class Row:
    recipe: str
    dataset: str
    params_m: float
    batch: int
    tokenise_s: float
    pipeline_sps: float
    train_sps: float

    @property
    def ratio(self) -> float:
        return self.pipeline_sps / self.train_sps

    @property
    def data_share(self) -> float:
        """Share of (data + step) time spent producing the batch."""
        return (1 / self.pipeline_sps) / (1 / self.pipeline_sps + 1 / self.train_sps)


def _pipeline_rate(samples: RobotSamples, cfg: VLAConfig, seconds: float) -> float:
    batches = RobotBatches(samples, micro_batch_size=cfg.training.micro_batch_size,
                           global_batch_size=cfg.training.global_batch_size, seed=0)
    for _ in range(10):
        next(batches)
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(20):
            next(batches)
        count += 20
    return count * cfg.training.micro_batch_size / (time.perf_counter() - started)


def _train_rate(samples: RobotSamples, cfg: VLAConfig, steps: int, warmup: int) -> tuple[float, float]:
    """(samples/s of an optimizer step, parameters in millions) for the recipe's model."""
    import itertools

    from trainer import parallel
    from trainer.loop import TrainStep, build_optimizer
    from trainer.model import build_model

    layout = parallel.initialize(cfg.parallel, cfg.training.seed)
    try:
        model = build_model(cfg.model)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        step = TrainStep(model, build_optimizer(model, cfg.optimizer), grad_clip=cfg.optimizer.grad_clip)
        per_step = cfg.training.global_batch_size // cfg.training.micro_batch_size
        batches = RobotBatches(samples, micro_batch_size=cfg.training.micro_batch_size,
                               global_batch_size=cfg.training.global_batch_size, seed=0,
                               data_rank=layout.data_rank, data_size=layout.data)
        # batches drawn up front: this times the step alone
        micro = [list(itertools.islice(batches, per_step)) for _ in range(warmup + steps)]
        for batch in micro[:warmup]:
            step(batch, cfg.optimizer.lr)
        times = []
        for batch in micro[warmup:]:
            started = time.perf_counter()
            step(batch, cfg.optimizer.lr)
            times.append(time.perf_counter() - started)
    finally:
        parallel.shutdown()
    # the median step: other processes on a shared host stretch some steps, not the typical one
    return cfg.training.global_batch_size / float(np.median(times)), params


def measure(recipe: Path, dataset: DemonstrationDataset, *, steps: int, seconds: float) -> Row:
    """One table row: ``recipe``'s pipeline and model on ``dataset``."""
    cfg = load_config(VLAConfig, recipe, ["--data.path", str(dataset.root)])
    card = dataset_card(dataset, name=recipe.stem, chunk_size=cfg.data.chunk_size, state_bins=cfg.data.state_bins,
                        action_bins=cfg.data.action_bins, mode=cfg.data.normalization, min_range=cfg.data.min_range)
    tokenise_s = float("inf")
    for _ in range(3):  # the fastest of three: the first also pays numpy's first-call costs
        started = time.perf_counter()
        samples = RobotSamples(dataset, card.tokenizer(), state_noise=cfg.data.state_noise)
        tokenise_s = min(tokenise_s, time.perf_counter() - started)
    cfg = resolve_model(cfg, samples.tokenizer.layout.vocab_size, samples.seq_length)
    pipeline = _pipeline_rate(samples, cfg, seconds)
    train, params = _train_rate(samples, cfg, steps, warmup=3)
    name = f"{dataset.root.name}: {len(dataset)} episodes, {dataset.num_frames:,} frames"
    return Row(recipe.stem, name, params, cfg.training.global_batch_size, tokenise_s, pipeline, train)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, help="LeRobot v3 dataset for every recipe (default: each recipe's data.path)")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES, help="comma-separated vla recipes")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per recipe")
    parser.add_argument("--seconds", type=float, default=3.0, help="time spent drawing batches per recipe")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fallback = Path(tmp) / "reach-50"
        for recipe in map(Path, args.recipes.split(",")):
            root = args.dataset or Path(load_config(VLAConfig, recipe).data.path)
            if not (root / "meta" / "info.json").is_file():
                if not fallback.exists():
                    from trainer.collect_demos import collect_demos

                    collect_demos("metaworld-mt1-reach", fallback, 50, workers=1, show_progress=False)
                root = fallback
            rows.append(measure(recipe, DemonstrationDataset(root), steps=args.steps, seconds=args.seconds))

    table = Table(title="robot data pipeline (one thread) vs what a training step consumes")
    for column in ("recipe", "dataset", "params", "global batch", "tokenise (once)", "pipeline samples/s",
                   "train step samples/s", "ratio", "data share of a step"):
        table.add_column(column, justify="left" if column in ("recipe", "dataset") else "right")
    for row in rows:
        table.add_row(row.recipe, row.dataset, f"{row.params_m:.2f} M", str(row.batch),
                      f"{row.tokenise_s * 1e3:.0f} ms",
                      f"{row.pipeline_sps:,.0f}", f"{row.train_sps:,.0f}", f"{row.ratio:,.0f}×",
                      f"{row.data_share:.2%}", style=None if row.ratio >= 5 else "red")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
