#!/usr/bin/env bash
# Fill .whl/ with the wheels tests/scripts/device_check.sh installs on a lent GPU machine (Python 3.12, x86-64, no
# network, its own torch): the versions of this checkout's venv (PY, default .venv/bin/python) of transformers and
# what it imports, accelerate, peft, torchao (--fp8) and liger-kernel (the benchmark's Liger row). Not torch, not datasets (pyarrow alone would pass the
# 64 MiB a call may carry). Run from the repository root; .whl/ must be git-ignored (.git/info/exclude).
set -eu
PY=${PY:-.venv/bin/python}
PACKAGES="transformers accelerate peft huggingface_hub tokenizers safetensors hf-xet httpx2 httpcore2 h11 anyio idna
truststore click regex typing_extensions tqdm packaging filelock fsspec PyYAML psutil"
pins=$(for name in $PACKAGES; do echo "$name==$($PY -c "import importlib.metadata as m; print(m.version('$name'))")"; done)
# torchao: the version of .venv-torchao (the Makefile's), whose prebuilt kernels need torch >= 2.11
torchao=$(ls -d .venv-torchao/torchao-*.dist-info | sed 's/.*torchao-\(.*\)\.dist-info/\1/')
# liger-kernel: the GPU benchmark's liger_compile row (pure Python over Triton, which the GPU machine's torch brings)
LIGER_VERSION=${LIGER_VERSION:-0.8.5}
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $pins "torchao==$torchao" "liger-kernel==$LIGER_VERSION"
du -sh .whl
