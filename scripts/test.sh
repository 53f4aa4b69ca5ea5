#!/usr/bin/env bash
# Set up everything and run the whole test suite: formatting, lint, types, import rules, pytest.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m "not slow"` or `-k gateway`).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
./scripts/ensure-postgres.sh

export SKYTRAIN_TEST_POSTGRES_URL=${SKYTRAIN_TEST_POSTGRES_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/test}
BIN=${SKYTRAIN_VENV:-.venv}/bin
echo "==> ruff"
"$BIN/ruff" format --check .
"$BIN/ruff" check .
echo "==> mypy"
"$BIN/mypy"
echo "==> import rules"
"$BIN/lint-imports"
echo "==> pytest"
"$BIN/pytest" "$@"
