# Two commands for a newcomer: `make demo` and `make test`. Both create .venv and install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all fuzz install clean bench lint format titan

# the C extensions (setup.py, disttrace/native/*.c) are built by the install; a change to them rebuilds them
$(STAMP): pyproject.toml setup.py $(wildcard disttrace/native/*.c)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip >/dev/null || true
	$(BIN)/pip install -q -e '.[test]'
	@# the integrations' extras, with torch pinned to the wheel installed above (never another torch); their
	@# tests skip, saying so, only when this install is impossible
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-pin.txt
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt -e '.[hf,lightning]' || echo "disttrace: the hf/lightning extras could not be installed; their tests will skip" >&2
	@# DeepSpeed on its own line: a failed DeepSpeed install (it builds from source) never costs the others
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt -e '.[deepspeed]' || echo "disttrace: the deepspeed extra could not be installed; its tests will skip" >&2
	@# the recorder's compiled statistics pass (run/record/fused.py); without it the same statistics come from numpy
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt -e '.[fast]' || echo "disttrace: the fast extra could not be installed; the recorder uses numpy" >&2
	touch $(STAMP)

install: $(STAMP)

# torchtitan as a client (tests/test_titan.py, the slow tier) lives in a venv of its own: its pins
# (datasets < 4.8, so huggingface-hub < 2) contradict the hf extra's transformers; torch is the same pin
TITAN_VENV := .venv-titan
$(TITAN_VENV)/.installed: $(STAMP) pyproject.toml setup.py
	$(PY) -m venv $(TITAN_VENV)
	cp $(VENV)/torch-pin.txt $(TITAN_VENV)/torch-pin.txt
	$(TITAN_VENV)/bin/pip install -q -c $(TITAN_VENV)/torch-pin.txt -e '.[titan]' || echo "disttrace: the titan extra could not be installed; its tests will skip" >&2
	touch $@

titan: $(TITAN_VENV)/.installed

# the reference path of the embedded default, then the whole method on it as one lab
demo: $(STAMP)
	$(BIN)/disttrace run manifests/default.toml
	$(BIN)/disttrace lab manifests/default.toml --fault bitflip-grad --step 3 --rank 1 --predict backward@3:1

# CI's tier: every test but the `slow` end-to-end jobs (crash, multi-node, the integrations, the attach
# bug families, calibration, the report's lab, the strategy and fault cases a kept case already covers),
# with 15% of the fuzz sample (`make fuzz` is the long run); it must stay well under CI's 15 minutes.
# Two pytest-xdist workers, a test file each at a time (its module fixtures made once): one worker alone
# keeps about 1.2 of the 2 cores busy, since much of a test is one process starting or waiting; the
# session's runs are shared between the workers (tests/conftest.py). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP) lint
	DISTTRACE_FUZZ_SCALE=$${DISTTRACE_FUZZ_SCALE:-0.15} OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile tests

# the formatter's check and the linter (both configured in pyproject.toml); `make format` applies them
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# everything, the slow tier included
test-all: $(STAMP) titan
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests

# the long fuzz: every generated-input test of tests/test_fuzz.py scaled to at least 10,000 inputs in all
# (make test runs its small CI sample); -s prints how many inputs and how the commands answered them
fuzz: $(STAMP)
	DISTTRACE_FUZZ_EXAMPLES=$${DISTTRACE_FUZZ_EXAMPLES:-10000} OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -s tests/test_fuzz.py

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) $(TITAN_VENV) runs/*/ *.egg-info build disttrace/native/*.so
