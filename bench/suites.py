"""Step and reset cost per suite family against each raw simulator's own step, with and without cameras.

    .venv/bin/python bench/suites.py [--families libero,aloha,ogbench] [ARGS passed to each]

Runs each family's script in a process of its own — ``bench/suites_libero.py``,
``bench/suites_aloha.py``, ``bench/suites_ogbench.py`` (MetaWorld and PushT:
``bench/render_cost.py``) — because simulators that load Mesa at import cannot share a
process in any order (``benchmarks/rendering.py``), and prints their tables one after the
other. Each table holds the raw simulator's step beside ours (target: ours ≤ 1.1× raw),
the cost of rendering on request, resets, and full-length episodes per minute per core.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
FAMILIES = {"libero": "suites_libero.py", "aloha": "suites_aloha.py", "ogbench": "suites_ogbench.py",
            "metaworld": "render_cost.py"}


class Clock:
    """Wall and process-CPU seconds of each call (the family benches time with it)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def time(self, fn, *args):  # noqa: ANN001, ANN201 (any callable, its result)
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn(*args)
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)
        return out

    def ms(self) -> tuple[float, float]:
        """Median wall and CPU milliseconds."""
        return float(np.median(self.wall) * 1e3), float(np.median(self.cpu) * 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="libero,aloha,ogbench",
                        help=f"comma-separated, of {', '.join(FAMILIES)} (default: libero,aloha,ogbench)")
    args, rest = parser.parse_known_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; "
                     f"choose from {', '.join(FAMILIES)}")
    status = 0
    for family in families:
        print(f"\n## {family} ({FAMILIES[family]})\n", flush=True)
        status |= subprocess.run([sys.executable, str(BENCH / FAMILIES[family]), *rest]).returncode
    return status


if __name__ == "__main__":
    raise SystemExit(main())
