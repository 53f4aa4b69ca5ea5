#!/usr/bin/env bash
# Make sure the PostgreSQL the tests use answers on 127.0.0.1:5432, starting it if it is down.
set -euo pipefail
if pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    exit 0
fi
echo "==> PostgreSQL is down: starting it"
if command -v pg_ctlcluster >/dev/null 2>&1; then
    for version in $(ls /etc/postgresql); do
        pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    done
fi
for _ in $(seq 1 30); do
    pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null && exit 0
    sleep 1
done
echo "PostgreSQL did not come up on 127.0.0.1:5432" >&2
exit 1
