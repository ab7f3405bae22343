# Two entry points for a fresh machine: `make demo` and `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PROTOS := $(shell find protos -name '*.proto')
STUBS := arceus/v1/stage_pb2.py

.PHONY: install demo test lint bench clean

install: $(STAMP) $(STUBS) $(VENV)/.system-stamp

# promtool (Debian's prometheus package) checks monitoring/ in the test suite; chromium and its driver run the
# browser tests of the admin and the dashboard (tests/e2e/browser.py); docker-compose's `config` validates
# deploy/compose.yaml (tests/deploy; it needs no container engine).
$(VENV)/.system-stamp: $(STAMP)
	(command -v promtool && command -v chromedriver && command -v docker-compose && command -v iptables) >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus chromium chromium-driver docker-compose iptables >/dev/null)
	touch $@

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch is pinned and installed first; an unpinned torch pulls CUDA packages.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev,demo]"
	touch $(STAMP)

$(STUBS): $(PROTOS) protos/generate.py $(STAMP)
	$(BIN)/python protos/generate.py

# `make demo DEMO_ARGS=--keep`: afterwards the dashboard's URL and login, serving until Ctrl-C.
DEMO_ARGS ?=
demo: install
	$(BIN)/python -m devtools.demo $(DEMO_ARGS)

# The suite runs against the real PostgreSQL and Redis of the machine (override by URL). The fast tests run on two
# pytest-xdist workers (each with a test database and a Redis database of its own, tests/conftest.py: 14 and 15
# here); then the slow ones, which start processes of their own (agents, clusters), also on two workers, a file's
# tests on one (its module fixtures built once; each worker's end-to-end tests share one cluster, tests/e2e/conftest.py).
# Both parts always run; `make test PYTEST_ARGS=tests/x` passes arguments to both.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/arceus
TEST_REDIS_URL ?= redis://127.0.0.1:6379/14
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
TEST_ENV = DATABASE_URL=$(TEST_DATABASE_URL) REDIS_URL=$(TEST_REDIS_URL)

# pytest exits 5 when a part selects no test (PYTEST_ARGS naming only slow or only fast ones): not a failure.
test: install
	$(TEST_ENV) $(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) $(PYTEST_ARGS); fast=$$?; \
	$(TEST_ENV) $(BIN)/python -m pytest -m slow -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); slow=$$?; \
	for code in $$fast $$slow; do [ $$code = 0 ] || [ $$code = 5 ] || exit $$code; done

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python bench/pipeline_vs_single.py
	$(BIN)/python bench/fault_trials.py
	$(BIN)/python bench/tensor_transfer.py
	$(BIN)/python bench/pipeline_vs_torch.py --schedule gpipe
	$(BIN)/python bench/pipeline_vs_torch.py --schedule 1f1b
	$(BIN)/python bench/shaped_pipeline.py
	$(BIN)/python bench/large_stage_memory.py
	$(BIN)/python bench/pipeline_step_cost.py
	$(BIN)/python bench/large_model.py

clean:
	rm -rf $(VENV) arceus/v1 .pytest_cache
