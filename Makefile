# Two set-up commands, each idempotent on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Real clients the end-to-end tests drive, pinned; installed beside the venv when npm is available.
CLIENT_TOOLS := @openai/codex@0.169.0 @anthropic-ai/claude-code@2.1.197
TOOLS_STAMP := .tools/.installed

.PHONY: install demo test lint format bench clean chromium

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(TOOLS_STAMP): Makefile
	@mkdir -p .tools
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-fund --no-audit --prefix .tools $(CLIENT_TOOLS) && touch $(TOOLS_STAMP) \
		|| echo "warning: could not install the Codex and Claude Code CLIs; their tests will be skipped"; \
	else echo "warning: npm not found; the Codex and Claude Code tests will be skipped"; fi

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/harmony-gateway serve --demo

# The playground's browser tests drive Debian's Chromium through Playwright (never `playwright install`).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then \
			(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
			|| echo "warning: could not install chromium; the browser tests will be skipped"; \
		else echo "warning: chromium is missing and installing it needs root:" \
			"run 'sudo apt-get install -y chromium'; the browser tests will be skipped"; fi; }

test: $(STAMP) $(TOOLS_STAMP) chromium
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	PATH="$(CURDIR)/.tools/node_modules/.bin:$$PATH" $(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/bench_gateway.py

clean:
	rm -rf $(VENV) .tools build *.egg-info src/*.egg-info test-artifacts
