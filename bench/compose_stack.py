"""The compose stack's costs: image builds (cold and cached), image sizes, start to healthy, an evaluation.

    .venv/bin/python bench/compose_stack.py [--cold] [--episodes 8] [--replicas 1]

The same steps as tests/compose/test_stack.py (tests/compose/harness.py), timed, without the
crash: the stand-in bases (podman only), the wheelhouse, `compose build` twice (the second
must reuse every layer), the images' sizes, `up` until the API and the policy server answer
`/readyz`, one MetaWorld reach evaluation of a random-init policy on the CPU policy server
(``--replicas K``: K replicas, `--scale policy-server=K`, registered as one policy by container name),
`down -v`. ``--cold`` uses an empty container storage (a temporary EVALFORGE_CONTAINERS_DIR),
so every image is built from nothing; the wheelhouse is reused either way (filling it is
pip's download time, not the build's).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="build every image from nothing (empty storage)")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=1, help="policy-server replicas (`--scale policy-server=K`)")
    args = parser.parse_args()
    if args.cold:
        os.environ["EVALFORGE_CONTAINERS_DIR"] = tempfile.mkdtemp(prefix="evalforge-containers-")

    from services.client import EvalForgeClient
    from tests.compose import harness

    engine = harness.find_engine()
    rows: list[tuple[str, str]] = [("engine", f"{engine.name} ({' '.join(engine.compose)})")]

    def timed(name: str, step):
        started = time.monotonic()
        result = step()
        rows.append((name, f"{time.monotonic() - started:.1f} s"))
        return result

    if engine.name == "podman":
        timed("stand-in bases (debootstrap, python, postgres, redis)", lambda: harness.ensure_standins(engine))
    timed("wheelhouse (check or fill)", harness.ensure_wheelhouse)
    with tempfile.TemporaryDirectory(prefix="evalforge-compose-bench-") as workdir:
        stack = harness.Stack(engine, Path(workdir), policy_replicas=args.replicas)
        first = timed("compose build" + (" (cold)" if args.cold else ""), stack.build)
        again = timed("compose build again (cached)", stack.build)
        rows.append(("second build reused every layer", "yes" if again == first else "NO"))
        for image in harness.BUILT.values():
            size = engine.run("image", "inspect", "--format", "{{.Size}}", image).stdout.strip()
            rows.append((f"image {image}", f"{int(size) / 1e9:.2f} GB"))
        bin_dir = Path(sys.executable).parent
        subprocess.run([str(bin_dir / "trainer"), "init-policy", "--suite", "metaworld-mt1-reach", "--preset", "1m",
                        "--out", str(stack.runs / "policy")], check=True, capture_output=True)
        for path in (stack.runs / "policy").rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            timed(f"up to healthy (API and {args.replicas} policy server(s) /readyz)", stack.up)
            key = (stack.runs / "api-key").read_text().strip()
            endpoints = [f"ws://{name}:8000/ws" for name in stack.replica_names()]
            with EvalForgeClient(stack.api_url, key) as client:
                policy = client.register_policy("bench-reach", endpoints[0], replicas=endpoints[1:])
                evaluation = client.submit_evaluation(policy.id, "metaworld-mt1-reach", args.episodes)
                done = timed(f"evaluation, {args.episodes} reach episodes (submit to finished)",
                             lambda: client.watch_evaluation(evaluation.id, poll_s=0.5, timeout_s=1800))
                rows.append(("evaluation status", f"{done.status.value} {dict(done.counts)}"))
                served = [stack.policy_metric(url, "evalforge_policy_requests_total", type="infer")
                          for url in stack.policy_urls()]
                rows.append(("infer requests per replica", ", ".join(f"{count:.0f}" for count in served)))
        finally:
            timed("down -v", stack.down)
    width = max(len(name) for name, _ in rows)
    print(f"{'step'.ljust(width)}  value")
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
