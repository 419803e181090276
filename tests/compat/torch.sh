#!/usr/bin/env bash
# The suite on the torch each Intel Gaudi release ships, one venv each under .venv-torch/<version>.
#
# usage: tests/compat/torch.sh [VERSION ...]   (default: every torch of the matrix in tests/compat/gaudi_torch.txt)
#        TORCH_TESTS=unit tests/compat/torch.sh 2.6.0      (tests/unit only: what CI runs on the oldest torch)
#
# PyPI's Linux builds of torch are CUDA builds (about 3 GB with their CUDA libraries; 1-3 minutes to install here)
# where a Gaudi's torch is a CPU build: they run on the CPU all the same, and the simulated Gaudi stands where a
# CPU build would (tests/fakes/README.md). The package is imported from the working tree; transformers and the rest
# are the newest that install beside each torch. torchao (--fp8 on CPU) and DeepSpeed go in folders of their own in
# the venv, on the path only of the tests that use them, as the Makefile keeps them apart from .venv; DeepSpeed's
# tests run after the rest (TORCH_TESTS=all). torchao 0.16 on every torch: the oldest release PEFT 0.21's LoRA
# layers accept beside them (0.12-0.14, made for torch 2.6-2.9, are refused at import); its float8 training runs in
# Python on 2.6-2.10 (its prebuilt kernels, for another torch, are not used).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
ROOT=${TORCH_COMPAT_ROOT:-.venv-torch}
TORCH_TESTS=${TORCH_TESTS:-all}
TORCHAO=${TORCHAO:-0.16.0}
# What touches every feature on another torch: the unit suite, then FSDP + sharded checkpoints, context parallelism,
# fp8, the fused loss, DDP and fast_ddp, the watchdog, resume and the simulated-Gaudi launches; DeepSpeed apart.
INTEGRATION=(
	tests/integration/devices/test_run_clm_on_the_simulated_hpu.py
	tests/integration/devices/test_hpu_launch_and_lazy_mode.py
	tests/integration/distributed/test_fast_ddp.py
	tests/integration/distributed/test_fsdp_trainings.py
	tests/integration/distributed/test_sequence_parallel_trainings.py
	tests/integration/supervision/test_stalled_slow_or_diverging_ranks.py
	tests/integration/checkpoints/test_sharded_checkpoints_launches.py
	tests/integration/checkpoints/test_resumed_trainings.py
	tests/integration/features/test_linear_cross_entropy.py
	tests/integration/precision/test_fp8.py
)
VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
	mapfile -t VERSIONS < <(sed -n 's/^[0-9.]*[[:space:]]\+\([0-9.]\+\).*/\1/p' tests/compat/gaudi_torch.txt | sort -uV)
fi
case "$TORCH_TESTS" in
unit) TESTS=(tests/unit) ;;
all) TESTS=(tests/unit "${INTEGRATION[@]}") ;;
*) TESTS=($TORCH_TESTS) ;;
esac

status=0
summary=()
for version in "${VERSIONS[@]}"; do
	venv="$ROOT/$version"
	if [ ! -f "$venv/.installed" ]; then
		rm -rf "$venv"
		"$PYTHON" -m venv "$venv"
		"$venv/bin/python" -m pip install -q "torch==$version" 2>&1 | grep -v "is ignored" || true
		"$venv/bin/python" -m pip install -q -e ".[tests]" 2>&1 | grep -v "is ignored" || true
		"$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')"
		pip_into() { "$venv/bin/python" -m pip install -q --no-deps --target "$@" 2>&1 | grep -v "is ignored" || true; }
		pip_into "$venv/torchao" "torchao==$TORCHAO"
		pip_into "$venv/deepspeed" deepspeed einops hjson msgpack ninja nvidia-ml-py py-cpuinfo
		touch "$venv/.installed"
	fi
	echo "=== torch $version ==="
	start=$(date +%s)
	result=passed
	if ! HF_HUB_OFFLINE=1 TORCHAO_DIR="$venv/torchao" "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"; then
		result=FAILED
		status=1
	fi
	if [ "$TORCH_TESTS" = all ] && ! HF_HUB_OFFLINE=1 PYTHONPATH="$PWD/$venv/deepspeed" PATH="$PWD/$venv/deepspeed/bin:$PATH" \
		"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/integration/distributed/test_deepspeed.py; then
		result=FAILED
		status=1
	fi
	summary+=("torch $version ($TORCH_TESTS): $result ($(($(date +%s) - start)) s)")
done
printf '%s\n' "${summary[@]}"
exit $status
