#!/bin/sh
# First start: initdb (UTF8, as the official image; SQL_ASCII would hand psycopg bytes) with POSTGRES_USER/POSTGRES_PASSWORD, create POSTGRES_DB, password auth from
# other hosts. Then exec the server as the postgres user (PID 1, so SIGTERM stops it cleanly).
set -eu
if [ "${1:-postgres}" = postgres ]; then
  [ "$#" -gt 0 ] && shift
  chown -R postgres:postgres "$PGDATA"
  chmod 700 "$PGDATA"
  if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD must be set}"
    user=${POSTGRES_USER:-postgres}
    pwfile=$(mktemp) && printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile" && chown postgres "$pwfile"
    setpriv --reuid=postgres --regid=postgres --init-groups \
      initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    setpriv --reuid=postgres --regid=postgres --init-groups \
      pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    db=${POSTGRES_DB:-$user}
    [ "$db" = postgres ] || setpriv --reuid=postgres --regid=postgres --init-groups createdb -U "$user" "$db"
    setpriv --reuid=postgres --regid=postgres --init-groups pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  fi
  exec setpriv --reuid=postgres --regid=postgres --init-groups postgres -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
