"""Episodes per policy needed to detect a 5- or 10-point difference: the table of docs/statistics.md.

    .venv/bin/python bench/statistics_power.py [--power 0.8] [--alpha 0.05] [--phi 0.5]

Two-sided level ``alpha``, power ``power``, baseline success rates 50%, 80%, 90% and a
candidate better by 5 or 10 points. Normal-approximation sample sizes (no continuity
correction), the usual planning formulas:

- unpaired (two evaluations on different seeds, compared with two success rates;
  Fleiss, Levin and Paik, *Statistical Methods for Rates and Proportions*, 3rd ed., 4.14):
  ``n = (z_a·√(2·p̄q̄) + z_b·√(p₁q₁ + p₂q₂))² / δ²`` per policy, ``p̄`` their mean;
- paired (the same tasks and seeds, McNemar's test; Connor 1987, Biometrics 43:207–211):
  ``n = (z_a·√ψ + z_b·√(ψ − δ²))² / δ²`` pairs, where ``ψ`` is the probability that a
  pair is discordant. ``ψ`` depends on how much the two policies' outcomes on the same
  seed agree; assuming their correlation is ``phi``,
  ``P(both succeed) = p₁p₂ + phi·√(p₁q₁p₂q₂)`` and ``ψ = p₁ + p₂ − 2·P(both succeed)``.
  ``phi = 0`` (outcomes independent given the seed) needs about the unpaired number;
  seeds that are hard for one policy tend to be hard for the other, so ``phi`` is
  usually positive and pairing saves episodes.

Pure arithmetic (stdlib), milliseconds; it prints a Markdown table.
"""

from __future__ import annotations

import argparse
import math
from statistics import NormalDist

BASELINES = (0.5, 0.8, 0.9)
DIFFERENCES = (0.05, 0.10)


def unpaired_episodes(p1: float, p2: float, alpha: float, power: float) -> int:
    """Episodes per policy for two independent success rates ``p1`` and ``p2``."""
    z_a, z_b = NormalDist().inv_cdf(1 - alpha / 2), NormalDist().inv_cdf(power)
    mean = (p1 + p2) / 2
    root = z_a * math.sqrt(2 * mean * (1 - mean)) + z_b * math.sqrt(p1 * (1 - p1) + p2 * (1 - p2))
    return math.ceil(root**2 / (p1 - p2) ** 2)


def discordance(p1: float, p2: float, phi: float) -> float:
    """P(exactly one of two outcomes succeeds) when their rates are ``p1``, ``p2`` and their correlation ``phi``."""
    both = p1 * p2 + phi * math.sqrt(p1 * (1 - p1) * p2 * (1 - p2))
    return p1 + p2 - 2 * both


def paired_episodes(p1: float, p2: float, phi: float, alpha: float, power: float) -> int:
    """Pairs (episodes per policy, same tasks and seeds) for McNemar's test."""
    z_a, z_b = NormalDist().inv_cdf(1 - alpha / 2), NormalDist().inv_cdf(power)
    psi = discordance(p1, p2, phi)
    delta = p2 - p1
    return math.ceil((z_a * math.sqrt(psi) + z_b * math.sqrt(psi - delta**2)) ** 2 / delta**2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--power", type=float, default=0.8)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--phi", type=float, default=0.5, help="assumed correlation of paired outcomes")
    args = parser.parse_args()
    print(f"| baseline | candidate | unpaired | paired, φ = {args.phi:g} (ψ) | paired, φ = 0 (ψ) |")
    print("|---:|---:|---:|---:|---:|")
    for p1 in BASELINES:
        for delta in DIFFERENCES:
            p2 = p1 + delta
            print(f"| {100 * p1:.0f}% | {100 * p2:.0f}% | {unpaired_episodes(p1, p2, args.alpha, args.power):,} | "
                  f"{paired_episodes(p1, p2, args.phi, args.alpha, args.power):,} "
                  f"({discordance(p1, p2, args.phi):.3f}) | "
                  f"{paired_episodes(p1, p2, 0.0, args.alpha, args.power):,} ({discordance(p1, p2, 0.0):.3f}) |")


if __name__ == "__main__":
    main()
