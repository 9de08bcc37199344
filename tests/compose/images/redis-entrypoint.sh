#!/bin/sh
# `redis-server ARGS` listens on every interface without protected mode, as the official image's does.
set -eu
if [ "${1:-}" = redis-server ]; then
  shift
  exec redis-server --bind '* -::*' --protected-mode no --dir /data "$@"
fi
exec "$@"
