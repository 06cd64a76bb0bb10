# Pagoda: the two commands a user needs are `make run` and `make test`.
# Both create/refresh .venv on first use; later calls skip setup unless pyproject.toml changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagoda-installed
# Without an NVIDIA GPU we install the CPU build of torch first (an unpinned torch would pull a multi-GB CUDA build).
HAS_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_CPU_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 7860
MODEL ?= smollm2-135m-instruct

.PHONY: run test setup browser clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifneq ($(HAS_NVIDIA),1)
	$(PY) -m pip install -q "$(TORCH_CPU_SPEC)"
endif
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) app.py serve --model $(MODEL) --host $(HOST) --port $(PORT)

# The UI tests drive Debian's Chromium (no browser download): install it when missing and we are root.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "note: install chromium (e.g. sudo apt-get install chromium) to run the browser tests"; fi; }

test: $(STAMP) browser
	$(PY) -m pytest -q tests

clean-venv:
	rm -rf $(VENV)
