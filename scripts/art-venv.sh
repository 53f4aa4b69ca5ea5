#!/usr/bin/env bash
# Build (or check) the virtual environment of openpipe-art, the ART client skytrain's /v1/preview
# routes serve, as its users install it: on Python 3.12 (it needs >= 3.12), unmodified, with its
# own dependencies, plus torch and transformers for its loss, tokenization and packing code,
# pinned in scripts/art-constraints.txt.
# The ART-compatibility tests run ART in it as the oracle (tests/fixtures/art_oracle.py) and
# its ServerlessBackend against a real control plane. Safe to run again: it only checks when
# the environment is complete.
#
#   scripts/art-venv.sh            # ~/.cache/skytrain/art-venv (SKYTRAIN_ART_VENV to put it elsewhere)
#
# It lives in the user's cache (SKYTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/skytrain), not in the
# checkout: every clone on a machine shares the one build.
#
# PyPI's torch for Linux is the CUDA build: the first run downloads about 3 GB (the CPU build
# exists for Python 3.11 only on machines without PyTorch's own index).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${SKYTRAIN_ART_VENV:-${SKYTRAIN_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:?is unset: set SKYTRAIN_CACHE_DIR}/.cache}/skytrain}/art-venv}
# One build at a time: the suite's processes (pytest-xdist) may each ask for it at once, and
# two builds in one directory would remove each other's files. The others wait, then find it
# ready.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
ART_VERSION=0.5.23
CHECK="import art, art.loss, art.preprocessing.pack, torch, transformers; \
assert __import__('importlib.metadata').metadata.version('openpipe-art') == '$ART_VERSION'"
# Written once the environment imports: it names the pins it was built with, so a change of
# pins rebuilds it and a check costs no import (importing ART takes a while).
READY="$VENV/skytrain-ready"
PINS=$(sha256sum scripts/art-constraints.txt | cut -d' ' -f1)

if [ -x "$VENV/bin/python" ] && [ "$(cat "$READY" 2>/dev/null)" = "$PINS" ]; then
    echo "==> $VENV: openpipe-art $ART_VERSION ready"
    exit 0
fi
PYTHON=${SKYTRAIN_ART_PYTHON:-}
if [ -z "$PYTHON" ]; then
    candidates=(python3.12 python3.13)
    # pyenv's shims answer only for the versions selected; its installed ones work directly.
    if command -v pyenv >/dev/null 2>&1; then
        for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[23](\.|$)'); do
            candidates+=("$(pyenv root)/versions/$version/bin/python3")
        done
    fi
    for candidate in "${candidates[@]}"; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "" 2>/dev/null; then
            PYTHON=$candidate
            break
        fi
    done
fi
if [ -z "$PYTHON" ]; then
    echo "error: openpipe-art $ART_VERSION needs Python >= 3.12 and none is on PATH" \
        "(set SKYTRAIN_ART_PYTHON)" >&2
    exit 3
fi
echo "==> building $VENV with $PYTHON: openpipe-art $ART_VERSION, torch, transformers"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip
"${PIP[@]}" install --progress-bar on -c scripts/art-constraints.txt \
    "openpipe-art==$ART_VERSION" torch transformers
"$VENV/bin/python" -c "$CHECK"
echo "$PINS" > "$READY"
echo "==> $VENV ready"
