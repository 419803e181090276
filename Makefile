# Both README commands work on a fresh clone: the first target that needs Python builds .venv/.
# torch goes in first (a CPU build, or the machine's own torch, e.g. Habana's on a Gaudi, when present)
# so that pip never pulls a multi-GB CUDA build as a dependency of something else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: venv demo test test-slow style bench clean

venv: $(STAMP)

$(STAMP): setup.py
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "Using this machine's torch ($$($(PYTHON) -c 'import torch; print(torch.__version__)'))"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install -q -e ".[tests,quality]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/language-modeling/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

# Tests left out of `make test` for time: ZeRO-Offload compiles DeepSpeed's CPU Adam on its first run (minutes).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

style: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
