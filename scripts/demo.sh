#!/usr/bin/env bash
# Set up what the demo needs (scripts/setup.sh without --test: no test stack, nothing
# system-wide) and run the demo: the embedded control plane and a local worker train
# SmolLM2-135M-Instruct with GRPO on CPU, printing the reward per step and plotting it.
# Extra arguments go to `skytrain demo` (see `skytrain demo --help`); SKYTRAIN_VENV picks
# the virtual environment (default .venv), as in scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${SKYTRAIN_VENV:-.venv}/bin/skytrain" demo "$@"
