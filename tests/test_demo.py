"""`make demo`'s path end to end at small sizes: demonstrations → training → export →
`evalforge up` → registration → an evaluation submitted through the REST API → results and
the leaderboard read back from the database; then a second run that reuses what the first
one built."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

from services.supervisor import free_port

REPO = Path(__file__).resolve().parents[1]


def _demo(root: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "scripts/demo.py", "--root", str(root), "--demos", "6", "--train-steps", "10",
               "--episodes-per-task", "2", "--max-steps", "8", "--engine", "hf", "--port", str(free_port()),
               "--policy-port", str(free_port())]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900,
                            env={**{k: v for k, v in os.environ.items()
                                    if k not in ("DATABASE_URL", "REDIS_URL", "EVALFORGE_BROKER_URL")},
                                 "COLUMNS": "160"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def test_demo_path_end_to_end_then_reuses_what_it_built(tmp_path):
    first = _demo(tmp_path).stdout
    for step in ("[1/5] demonstrations: 6 scripted-expert episodes", "[2/5] training", "[3/5] stack",
                 "[4/5] evaluation: POST /evaluations", "[5/5] results of evaluation 1"):
        assert step in first, first
    assert (tmp_path / "vla-reach-10steps" / "policy" / "policy.json").is_file(), "the policy was exported"
    assert re.search(r"│\s+reach-v3\s+│\s+2\s+│", first), first  # the per-task table
    assert "Leaderboard for metaworld-mt1-reach" in first and "reach-bc-fast" in first

    second = _demo(tmp_path).stdout
    assert "[1/5] demonstrations: reusing" in second and "[2/5] training: reusing" in second
    assert "[5/5] results of evaluation 2" in second
    with sqlite3.connect(tmp_path / "evalforge.db") as db:  # both evaluations are in the store
        rows = db.execute("SELECT id, status FROM evaluations ORDER BY id").fetchall()
        episodes = db.execute("SELECT count(*) FROM episodes WHERE status IN ('succeeded', 'failed')").fetchone()
    assert rows == [(1, "finished"), (2, "finished")] and episodes == (4,)
    state = json.loads((tmp_path / "demo" / "stack" / "stack.json").read_text())
    assert state["status"] == "stopped" and state["broker_url"].startswith("filesystem://"), state
