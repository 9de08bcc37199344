"""`python -m benchmarks`: list the registered suites and their cameras (no simulator is imported)."""

from __future__ import annotations

from benchmarks.registry import catalogue


def main() -> None:
    rows = [(s["name"], str(len(s["tasks"])), f'{s["state_dim"]}/{s["action_dim"]}',
             "/".join(sorted({str(t["max_steps"]) for t in s["tasks"]})), "yes" if s["has_expert"] else "no",
             " ".join(f'{c["name"]}:{c["height"]}x{c["width"]}' for c in s["cameras"]) or "-")
            for s in catalogue()]
    header = ("suite", "tasks", "state/action", "max steps", "expert", "cameras (default size)")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
