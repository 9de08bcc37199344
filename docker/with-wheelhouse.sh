#!/bin/sh
# Runs a command with pip pointed at the wheelhouse bind-mounted at /wheelhouse, and at nothing
# else, when it holds wheels; otherwise as is (pip then uses the package index).
if ls /wheelhouse/*.whl >/dev/null 2>&1; then
  export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse
fi
exec "$@"
