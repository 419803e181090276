#!/usr/bin/env bash
# The one prepared call on a lent GPU machine (no network; its own torch, which stays). From the repository root,
# with .whl/ filled by tests/scripts/device_wheels.sh (git-ignored, so the call carries it: carry [".whl"]):
#     bash tests/scripts/device_check.sh
# Every step is tee'd to $OUT/*.log (8 files at most come back: steps.log, bench.log, gpu.json, benchmarks.md,
# eval_graphs.log/.json, tests_cuda.log, tests.log); a step that fails or runs out of time never stops the next one. About 10
# minutes in all:
#   the GPU benchmark (benchmarks/gpu.py, BENCH_SECTIONS=gpu, its liger_compile row from .whl/liger_kernel-*.whl) 345 s: $OUT/gpu.json, $OUT/benchmarks.md
#   evaluation with and without --use_hpu_graphs_for_inference (benchmarks/eval_graphs.py) 90 s
#   the CUDA-relevant tests 165 s (the suite's files that train or wrap on the default device; not the
#   examples, TRL or the CLI, which need datasets, absent there; not the simulator's launch and e2e tests)
set -u
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
start=$(date +%s)
elapsed() { echo "== $1 at $(($(date +%s) - start)) s" | tee -a "$OUT/steps.log"; }

elapsed "install"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v torchao) 2>&1 | tail -5 | tee -a "$OUT/steps.log"
# torchao beside the rest, as the Makefile's .venv-torchao: tests/conftest.py adds it where a test needs it
# (imported by transformers, it logs in every process, which the one-line error tests would see)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .venv-torchao \
    .whl/torchao-*.whl 2>&1 | tail -5 | tee -a "$OUT/steps.log"
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

elapsed "versions"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 - <<'EOF'
import importlib.metadata as m, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "capability", torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
for name in ("transformers", "accelerate", "peft", "huggingface_hub", "tokenizers", "safetensors", "triton",
             "pytest", "pytest-xdist", "pytest-timeout", "numpy"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "absent")
import optimum_gaudi, transformers
print("optimum_gaudi from", optimum_gaudi.__file__, "transformers from", transformers.__file__)
EOF
} 2>&1 | tee -a "$OUT/steps.log"

elapsed "gpu benchmark"
PYTHONPATH=$PYTHONPATH:$PWD/.venv-torchao BENCH_SECTIONS=gpu BENCH_GPU_JSON=$OUT/gpu.json BENCH_GPU_BUDGET=330 \
    timeout 345 python3 benchmarks/run.py 2>&1 | tee "$OUT/bench.log"
cp docs/benchmarks.md "$OUT/benchmarks.md" 2>/dev/null

elapsed "evaluation with and without inference graphs"
BENCH_GPU_EVAL_JSON=$OUT/eval_graphs.json timeout 90 python3 -m benchmarks.eval_graphs 2>&1 | tee "$OUT/eval_graphs.log"

elapsed "tests"
workers=""
python3 -c "import xdist" 2>/dev/null && workers="-n 8"
per_test=""
python3 -c "import pytest_timeout" 2>/dev/null && per_test="--timeout 60"
# first the tests that exercise CUDA itself, then the files that train on the default device (the GPU here)
timeout 75 python3 -m pytest -q -p no:cacheprovider $workers $per_test -rfE \
    tests/integration/features/test_cuda_graphs.py tests/integration/precision/test_fp8.py tests/integration/features/test_gradient_checkpointing.py tests/unit/devices/test_devices.py \
    tests/integration/benchmarks/test_gpu_benchmark.py > "$OUT/tests_cuda.log" 2>&1
tail -40 "$OUT/tests_cuda.log"
timeout 90 python3 -m pytest -q -p no:cacheprovider $workers $per_test -rfE \
    tests/unit/precision/test_precision.py tests/integration/features/test_compilation.py tests/unit/features/test_compile_args.py tests/integration/features/test_llm_kernels.py \
    tests/integration/features/test_static_batch.py tests/unit/trainers/test_mixin.py tests/unit/features/test_graphs.py tests/integration/trainers/test_trainer.py \
    tests/integration/features/test_linear_cross_entropy.py tests/integration/precision/test_precision_trainings.py \
    > "$OUT/tests.log" 2>&1
tail -40 "$OUT/tests.log"

elapsed "done"
