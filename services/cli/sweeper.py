"""Re-enqueue episodes left pending or whose worker died, and close what is done (a loop).

One sweeper per deployment is enough; two are safe, only wasteful
(services/workers/sweeper.py says what a sweep does).
"""

from __future__ import annotations

import argparse
import logging

from services.cli import add_log_level


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", help="sweep once and exit")
    add_log_level(parser)


def run(args: argparse.Namespace) -> int:
    from services.store.migrate import check_current
    from services.workers.settings import settings
    from services.workers.sweeper import make_sweeper

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_current()
    sweeper = make_sweeper(settings)
    if args.once:
        report = sweeper.sweep_once()
        print(f"re-enqueued {len(report.reenqueued)} episodes; worker_lost in evaluations {report.lost}; "
              f"cancelled running episodes in {report.cancelled}; finalised {report.finalised}")
        return 0
    sweeper.run_forever()
    return 0
