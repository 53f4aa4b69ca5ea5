#!/usr/bin/env bash
# Set up everything and run the whole test suite: formatting, lint, types, import rules, pytest.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m "not slow"` or `-k gateway`).
set -euo pipefail
cd "$(dirname "$0")/.."

# The whole suite compares skytrain with ART, which runs in an environment of its own
# (scripts/art-venv.sh). Where it is not built yet (a fresh CI machine: about 3 GB of downloads,
# mostly waiting on the network), the build starts now, beside the set-up and checks below,
# rather than in pytest, where two of its processes would wait on it. ART's tests still wait
# for it to end (the script takes a lock) and run the script again, which rebuilds what
# failed and shows why.
if [ $# -eq 0 ]; then
    ./scripts/art-venv.sh >/dev/null 2>&1 &
fi
./scripts/setup.sh --test
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
# Three processes (pytest-xdist), each test file on one of them: on 2 cores the suite's many
# waits (servers starting, workers registering) overlap. Files go out longest first
# (tests/durations.json; tests/conftest.py orders them). `-n 0` runs it in this process.
# One torch thread each (the processes and the workers they start), unless the caller says
# otherwise: three processes of two threads on two cores wait on each other's descheduled
# threads more than they compute.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$BIN/pytest" -n "${SKYTRAIN_TEST_PROCESSES:-3}" --dist loadfile --no-loadscope-reorder "$@"
