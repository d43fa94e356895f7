# Tessera developer entry points. Build outputs and Go caches live under $(TESSERA_CACHE), never
# in the repo.
TESSERA_CACHE ?= $(HOME)/.cache/tessera
export TESSERA_CACHE
export GOCACHE := $(TESSERA_CACHE)/go-build
export GOMODCACHE := $(TESSERA_CACHE)/gomod
BIN_DIR := $(TESSERA_CACHE)/bin

VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEVCLUSTER := $(PYTHON) -m scheduler_plugins.cli cluster
CLUSTER_NAME ?= tessera
NODES ?= 0
PROFILE ?= examples/cluster-profile.yaml
# What each entry point builds: `hack/build-tools.sh --set demo|test` (the sets are defined
# there; cached, rebuilt only when inputs change).
# One set of Go build flags for the tools build and the shim's vet and tests (-trimpath is what
# hack/build-tools.sh compiles with): the shim's tests then reuse the kube-scheduler packages
# compiled for tessera-scheduler instead of compiling them all again.
GO_FLAGS := -trimpath
JAEGER ?= 0

.PHONY: setup demo up down status simulate test lint typecheck unit go-test integration bench bench-cluster tools tools-demo tools-test cluster-up cluster-down cluster-status

## setup: Python virtualenv with Tessera and its dev tools (re-run when pyproject.toml changes)
setup: $(STAMP)
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -e '.[dev]'
	touch $@

## demo: the main job — local cluster + Tessera scheduling example workloads, printed results
demo: setup tools-demo
	$(VENV)/bin/tessera demo

## up: a local cluster with fake GPU nodes and the whole Tessera stack, kept until `make down` (JAEGER=1: with Jaeger)
up: setup tools-demo
	$(if $(filter 1,$(JAEGER)),bash hack/build-tools.sh jaeger)
	$(VENV)/bin/tessera up $(if $(filter 1,$(JAEGER)),--jaeger)

## down: stop everything `make up` started
down: setup
	$(VENV)/bin/tessera down

## status: health of each component of `make up`
status: setup
	$(VENV)/bin/tessera status

## simulate: the offline core on the shipped examples (tessera simulate), no cluster needed
simulate: setup
	@bash hack/simulate-examples.sh

## test: everything — lint (ruff, the import contract), strict typing, unit + property tests, Go shim tests, integration tests
# The tools are built before the Go tests: go vet/test then compile nothing of kube-scheduler
# again, and on a cold cache the build shows its progress instead of a silent go vet.
test: lint typecheck unit tools-test go-test integration

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff format --check api scheduler_plugins node_agent tests benchmarks

typecheck: setup
	$(VENV)/bin/mypy

unit: setup
	$(VENV)/bin/pytest tests/unit tests/property

## go-test: vet and unit-test the Go kube-scheduler shim (sidecar-go) against an in-process server
go-test:
	cd sidecar-go && GOTOOLCHAIN=local go vet $(GO_FLAGS) ./... && GOTOOLCHAIN=local go test $(GO_FLAGS) ./...

integration: setup tools-test
	$(VENV)/bin/pytest tests/integration tests/e2e

## bench: core benchmarks (decision latency vs. a per-call rebuild; MIG placement quality; GC pause; MIG churn; trace replay)
bench: setup
	$(PYTHON) -m benchmarks.placement_quality
	$(PYTHON) -m benchmarks.decision_latency
	$(PYTHON) -m benchmarks.gc_pause
	$(PYTHON) -m benchmarks.mig_churn
	$(PYTHON) -m benchmarks.trace_replay

## bench-cluster: Tessera vs the stock kube-scheduler on a kwok cluster (BENCH_NODES=1000 BENCH_PODS=10000)
BENCH_NODES ?= 1000
BENCH_PODS ?= 10000
bench-cluster: setup tools-test
	$(VENV)/bin/tessera bench --nodes $(BENCH_NODES) --pods $(BENCH_PODS)

## tools: build every tool (etcd, kube-apiserver, kubectl, kwok, tessera-scheduler, kube-scheduler, helm, jaeger) into $(BIN_DIR) (cached)
tools:
	bash hack/build-tools.sh

tools-demo:
	bash hack/build-tools.sh --set demo

tools-test:
	bash hack/build-tools.sh --set test

## cluster-up: start the local dev cluster (NODES=N PROFILE=FILE to add fake GPU nodes)
cluster-up: setup tools-demo
	$(DEVCLUSTER) up --name $(CLUSTER_NAME) $(if $(filter-out 0,$(NODES)),--nodes $(NODES) --profile $(PROFILE))

## cluster-down: stop every process of the dev cluster
cluster-down:
	$(DEVCLUSTER) down --name $(CLUSTER_NAME)

cluster-status:
	$(DEVCLUSTER) status --name $(CLUSTER_NAME)
