#!/usr/bin/env bash
# Every GPU check in one run that fits a lent GPU machine's time: the gpu test tier
# (tests/gpu), then the benchmarks. The default phases' limits add up to 560 s, under a lent
# machine's 600 s a command. Each phase has its own time limit, so a phase that hangs costs
# only its share. Logs and results go into OUT/gpu_check.tgz, written again
# after each phase: one file (a lease returns only a few), and whatever the phases before a
# cut-off run finished.
#
#   benchmarks/gpu_check.sh OUT [PHASE...]   PHASE: tests decode shapes profile serving churn
#                                            (default: tests decode shapes serving churn)
#
# The machine has torch, triton, transformers and peft, and no network. Packages it lacks, in
# the versions pyproject.toml pins, travel as wheels in .whl/ (installed into /tmp/site):
# google-re2, llguidance, gguf, and jsonschema with jsonschema-specifications, referencing and
# rpds-py (`pip download --no-deps --only-binary=:all: --python-version 3.12` with the
# manylinux platforms). The bundled model's tokenizer files go in .gpu/tokenizer/ (the
# benchmarks' random models use them; the tests build their own).
#
# A lent machine gets a copy of the working tree whose git commit may not be the one checked
# out: name the commit where the results are recorded. For a shorter lease: PEFT_REPS (PEFT's
# mixed batch in gpu_serving, default 1; 0 skips PEFT), CHURN_REPS (default 3), DECODE_SIDES
# (gpu_decode_step's sides, default torch,triton), and OTHER_LORA_KERNELS, another
# triton_sgmv.py whose mixed decode step gpu_kernel_shapes times beside ours.
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUT [PHASE...]}
shift
phases=${*:-tests decode shapes serving churn}
mkdir -p "$out"
raw=$(mktemp -d)
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH="$PWD"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PWD:/tmp/site"
fi
tok=()
[ -d .gpu/tokenizer ] && tok=(--tokenizer .gpu/tokenizer)
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c 'import torch, triton, transformers, peft; print("torch", torch.__version__,
"cuda", torch.version.cuda, "triton", triton.__version__, "transformers",
transformers.__version__, "peft", peft.__version__)'
} >"$raw/device.txt" 2>&1
cat "$raw/device.txt"

phase() {  # name seconds command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$raw/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0))s" | tee -a "$raw/$name.log"
    tar -czf "$out/gpu_check.tgz" -C "$raw" .
}

shapes=()  # the kernel shapes gpu_kernel_shapes found fastest, for the phases after it
for p in $phases; do
    case $p in
    tests) phase tests 75 python3 -m pytest tests/gpu -m gpu -v -n 8 -p no:cacheprovider \
        --timeout 200 -W ignore::FutureWarning
        # the fused element-wise kernels broken on this GPU: the benchmarks go on without them
        if grep -qE "(FAILED|ERROR) tests/gpu/test_elementwise_cuda" "$raw/tests.log"; then
            echo "=== element-wise kernels failed: LORASERVE_FUSED_GPU=0 from here on"
            export LORASERVE_FUSED_GPU=0
        fi ;;
    decode) phase decode 75 python3 benchmarks/gpu_decode_step.py --pairs 1 "${tok[@]}" \
        --sides "${DECODE_SIDES:-torch,triton}" --json "$raw/gpu_decode_step.json" ;;
    shapes) phase shapes 100 python3 benchmarks/gpu_kernel_shapes.py "${tok[@]}" \
        ${OTHER_LORA_KERNELS:+--other-lora-kernels "$OTHER_LORA_KERNELS"} \
        --json "$raw/gpu_kernel_shapes.json"
        best=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["best"])' \
            "$raw/gpu_kernel_shapes.json" 2>/dev/null)
        [ -n "$best" ] && shapes=(--kernel-shapes "$best") && echo "=== kernel shapes $best" ;;
    profile) phase profile 60 python3 benchmarks/gpu_profile.py --step-reps 1 "${tok[@]}" \
        --json "$raw/gpu_profile.json" ;;
    serving) phase serving 110 python3 benchmarks/gpu_serving.py --models llama-1b \
        --reps 3 --peft-reps "${PEFT_REPS:-1}" --peft-sequential-reps 0 "${tok[@]}" "${shapes[@]}" \
        --json "$raw/gpu_serving.json" ;;
    churn) phase churn 200 python3 benchmarks/gpu_churn.py --configs B,A,B-blocking \
        --reps "${CHURN_REPS:-3}" "${tok[@]}" "${shapes[@]}" --json "$raw/gpu_churn.json" ;;
    *) echo "unknown phase $p" ;;
    esac
done
