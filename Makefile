# Both README commands work on a fresh clone: the first target that needs Python builds .venv/.
# torch goes in first (a CPU build, or the machine's own torch, e.g. Habana's on a Gaudi, when present)
# so that pip never pulls a multi-GB CUDA build as a dependency of something else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
# torchao (--fp8 on CPU/CUDA) lives beside .venv, not in it: imported by transformers, it logs warnings about its
# prebuilt CUDA extensions in every process, which would break the tests that a bad input prints one line.
# tests/integration/precision/test_fp8.py puts it on sys.path.
TORCHAO := .venv-torchao

.PHONY: venv demo test test-fast test-deepspeed test-compat test-compat-all test-compat-torch test-compat-trl style bench clean

venv: $(STAMP)

$(STAMP): setup.py
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "Using this machine's torch ($$($(PYTHON) -c 'import torch; print(torch.__version__)'))"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install -q -e ".[tests,quality]"
	$(PY) -m pip install -q --target $(TORCHAO) "torchao>=0.10"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/language-modeling/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

# the unit tests only (tests/unit: in process, each a few seconds at most): a few minutes where `make test` takes most
# of an hour; tests/integration (processes, launches, kill sweeps, slow in-process runs) is left to `make test`
test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit

# DeepSpeed ZeRO 1-3 and Offload on 2 CPU processes, in a venv of their own (.venv-deepspeed): with DeepSpeed
# importable, the main suite hung in tests/integration/checkpoints/test_checkpoints_killed_or_on_a_full_disk.py (a
# forked child stuck on a lock). The first run compiles DeepSpeed's shared-memory all-reduce and CPU Adam (a few
# minutes, once).
DS_VENV := .venv-deepspeed
test-deepspeed:
	@test -f $(DS_VENV)/.installed || { $(PYTHON) -m venv $(DS_VENV) && $(DS_VENV)/bin/pip install -q "torch==$(TORCH_VERSION)" \
		&& $(DS_VENV)/bin/pip install -q -e ".[tests,deepspeed]" && touch $(DS_VENV)/.installed; }
	$(DS_VENV)/bin/python -m pytest -q tests/integration/distributed/test_deepspeed.py

# The core suite on the oldest supported transformers and the newest (with the newest accelerate and peft), each in
# .venv-compat/<version>; the core suite includes tests/unit/trainers/test_internals.py (the internals the package relies on);
# COMPAT_VERSIONS="5.4.0 5.10.4" picks others, test-compat-all takes every 5.x minor release and 4.57.
COMPAT_VERSIONS ?=
test-compat:
	tests/compat/run.sh $(COMPAT_VERSIONS)

test-compat-all:
	tests/compat/run.sh $$(tests/compat/releases.sh)

# The unit suite and an integration set touching every feature (FSDP + sharded checkpoints, context parallelism, fp8,
# the fused loss, DDP and fast_ddp, the watchdog, resume, simulated-Gaudi launches) on the torch each Intel Gaudi
# release ships (tests/compat/gaudi_torch.txt: 2.6, 2.7, 2.9, 2.10), one venv each in .venv-torch/<version>: PyPI's
# CUDA builds, about 5 GB a venv, run on the CPU. The newest torch is make test's. TORCH_VERSIONS="2.6.0" picks
# some, TORCH_TESTS=unit runs the unit suite only (CI: the oldest).
TORCH_VERSIONS ?=
test-compat-torch:
	tests/compat/torch.sh $(TORCH_VERSIONS)

# optimum_gaudi.trl on the oldest TRL it supports (the newest is in .venv, run by make test)
test-compat-trl:
	CORE_TESTS=tests/integration/trainers/test_trl.py tests/compat/run.sh trl==1.0.0

style: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .venv-compat .venv-torch build *.egg-info
