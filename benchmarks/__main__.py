"""`python -m benchmarks`: list the registered suites (no simulator is imported)."""

from __future__ import annotations

from benchmarks.registry import catalogue


def main() -> None:
    rows = [(s["name"], str(len(s["tasks"])), f'{s["state_dim"]}/{s["action_dim"]}',
             "/".join(sorted({str(t["max_steps"]) for t in s["tasks"]})), "yes" if s["has_expert"] else "no")
            for s in catalogue()]
    header = ("suite", "tasks", "state/action", "max steps", "expert")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
