#!/usr/bin/env bash
# Wheels for scripts/gpu-check.sh on a CUDA machine that reaches no package index (a lent GPU
# box): the control plane's and worker's dependencies that such an image lacks (torch,
# transformers and peft are the image's own), at the versions of scripts/constraints.txt,
# fetched here for the machine's Python.
#
# Usage: scripts/gpu-wheels.sh DIR [PINS]
#   DIR   where the wheels go (then: SKYTRAIN_GPU_WHEELS=DIR scripts/gpu-check.sh there)
#   PINS  the machine's `pip list --format=freeze` (gpu-check.sh writes $OUT/system-pins.txt):
#         what it has already is left out, so its own versions stay in use
#   PYTHON_VERSION  the machine's Python (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: scripts/gpu-wheels.sh DIR [PINS]}
PINS=${2:-}
mkdir -p "$DIR"

# The server extra, what the worker imports beyond the image's ML stack, and the test plugins.
NAMES='alembic|boto3|fastapi|ijson|msgspec|psutil|psycopg|psycopg-binary|pydantic|pydantic-settings'
NAMES+='|protobuf|python-multipart|rich|sqlalchemy|tenacity|typer|uvicorn|httptools|watchfiles'
NAMES+='|websockets|wheel|openai|typing-extensions|cryptography|gguf|pytest-asyncio|pytest-timeout'
requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
grep -iE "^($NAMES)==" scripts/constraints.txt >"$requirements"

python3 -m pip download --quiet --only-binary=:all: --dest "$DIR" \
    --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -r "$requirements" -c scripts/constraints.txt

if [ -n "$PINS" ]; then
    # Leave out what the machine has, but the typing helpers pydantic needs new enough.
    python3 - "$DIR" "$PINS" <<'PY'
import pathlib, re, sys
folder, pins = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
have = {norm(line.split("==")[0]) for line in pins.read_text().splitlines() if "==" in line}
keep = {"typing-extensions", "typing-inspection"}
for wheel in sorted(folder.glob("*.whl")):
    name = norm(wheel.name.split("-")[0])
    if name in have and name not in keep:
        wheel.unlink()
PY
fi
echo "wheels in $DIR: $(find "$DIR" -name "*.whl" | wc -l)"
du -sh "$DIR"
