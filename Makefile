# Two commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEMO    ?= demo
# MLX's CPU backend ships a slow reference BLAS; Debian's OpenBLAS gives the same
# results about 8x faster. Used when present (installed by `make openblas`).
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
RUN     := $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS)) PYTHONPATH=$(CURDIR)

.PHONY: demo test test-fast lint install openblas sshd chromium clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP) openblas sshd chromium

# Best effort: only on Linux with apt and root; everything works without it, slower.
openblas:
	@if [ "$$(uname)" = Linux ] && [ ! -e $(OPENBLAS) ] && command -v apt-get >/dev/null \
	    && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq libopenblas0-pthread) >/dev/null 2>&1 \
	    || echo "note: could not install libopenblas0-pthread; MLX's CPU BLAS will be slower"; \
	fi

# The lab (`segctl lab up N`, tests/lab/) gives each host its own sshd: best effort
# too; without it those tests skip and say why.
sshd:
	@if [ "$$(uname)" = Linux ] && [ ! -x /usr/sbin/sshd ] && command -v apt-get >/dev/null \
	    && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends openssh-server openssh-client iproute2) >/dev/null 2>&1 \
	    || echo "note: could not install openssh-server; the lab tests will skip"; \
	fi

# tests/test_report.py opens `segctl report`'s page in a headless Chromium: best
# effort as well; without it that test skips and says why.
chromium:
	@if [ "$$(uname)" = Linux ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null \
	    && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
	    || echo "note: could not install chromium; the report's browser test will skip"; \
	fi

# The demo sweep on the embedded default: Ray on this machine as a one-node fleet,
# stores in $(DEMO)/home (state.db, telemetry/, memory.zarr, adapters.zarr).
demo: install
	@$(RUN) SEGCTL_HOME=$(CURDIR)/$(DEMO)/home $(BIN)/segctl cluster down >/dev/null 2>&1 || true
	@rm -rf $(DEMO)
	$(RUN) $(BIN)/segctl init-demo $(DEMO)
	$(RUN) SEGCTL_HOME=$(CURDIR)/$(DEMO)/home $(BIN)/segctl submit $(DEMO)/sweep.yaml; \
	  rc=$$?; \
	  $(RUN) SEGCTL_HOME=$(CURDIR)/$(DEMO)/home $(BIN)/segctl gather demo-1 --out $(DEMO)/best --best 2 \
	    && $(RUN) SEGCTL_HOME=$(CURDIR)/$(DEMO)/home $(BIN)/segctl status demo-1; \
	  $(RUN) SEGCTL_HOME=$(CURDIR)/$(DEMO)/home $(BIN)/segctl cluster down >/dev/null; \
	  echo "adapters:  $(DEMO)/best/<trial>/ (mlx_lm.load('$(DEMO)/model', adapter_path='$(DEMO)/best/<trial>')), manifest $(DEMO)/best/manifest.json"; \
	  echo "telemetry: $(DEMO)/home/telemetry/ (Parquet by sweep), $(DEMO)/home/memory.zarr, $(DEMO)/home/state.db"; \
	  exit $$rc

# The lab's fault scenarios and the fleet end to end (mostly waiting) run beside
# the rest: tests/run.sh.
test: install
	$(RUN) bash tests/run.sh $(BIN)/python

# Lint and import order (pyproject's [tool.ruff]), then types (pyproject's
# [tool.mypy]); CI runs it before the tests. mypy finds segctl.engine through
# segctl/engine, a link to engine/ (one per subpackage).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The inner loop: everything but Ray fleets, the lab and the model-family walk
# (one OpenBLAS thread a worker: tests/run.sh says why).
test-fast: install
	$(RUN) OPENBLAS_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not fleet and not slow"

clean:
	rm -rf $(VENV) $(DEMO) .pytest_cache
