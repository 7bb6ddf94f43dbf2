# Two commands for a newcomer: `make demo` and `make test`. Both create .venv and install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip >/dev/null || true
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# the reference path of the embedded default, then the whole method on it as one lab
demo: $(STAMP)
	$(BIN)/disttrace run manifests/default.toml
	$(BIN)/disttrace lab manifests/default.toml --fault bitflip-grad --step 3 --rank 1 --predict backward@3:1

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests

bench: $(STAMP)
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) runs/*/ *.egg-info
