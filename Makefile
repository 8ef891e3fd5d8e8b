# Two set-up commands, each idempotent on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# One stamp per extra the venv holds: `make demo` installs the gateway and the SDK its examples use
# (`.[demo]`), `make test` everything the suite needs (`.[test]`, which holds the demo extra, so it
# stamps both). Switching between them installs only what is missing; a changed pyproject.toml
# reinstalls whichever is asked for next.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed-test
# Real clients the end-to-end tests drive, pinned; installed beside the venv when npm is available.
CLIENT_TOOLS := @openai/codex@0.169.0 @anthropic-ai/claude-code@2.1.197
TOOLS_STAMP := .tools/.installed
# Real engine servers for the conformance tests (tests/real_engines), each in its own environment under
# the project's cache folder, plus the tiny Harmony-trained gpt-oss they serve (cached by recipe hash).
ENGINES := .cache/engines
MLX_VENV := $(ENGINES)/mlx-venv
MLX_STAMP := $(MLX_VENV)/.installed
MLX_PACKAGES := smg-grpc-servicer==0.14.1 'mlx[cpu]==0.32.4' mlx-lm==0.31.3

.PHONY: install demo test lint format bench clean chromium dnsmasq engines

# $(call install_extra,NAME): the venv (created when missing) with the project and its NAME extra.
define install_extra
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(1)]'
endef

$(DEMO_STAMP): pyproject.toml
	$(call install_extra,demo)
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml
	$(call install_extra,test)
	touch $(STAMP) $(DEMO_STAMP)

$(TOOLS_STAMP): Makefile
	@mkdir -p .tools
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-fund --no-audit --prefix .tools $(CLIENT_TOOLS) && touch $(TOOLS_STAMP) \
		|| echo "warning: could not install the Codex and Claude Code CLIs; their tests will be skipped"; \
	else echo "warning: npm not found; the Codex and Claude Code tests will be skipped"; fi

$(MLX_STAMP):
	test -x $(MLX_VENV)/bin/python || $(PYTHON) -m venv $(MLX_VENV)
	$(MLX_VENV)/bin/pip install --quiet $(MLX_PACKAGES) && touch $(MLX_STAMP) \
		|| echo "warning: could not install the MLX engine server; the real-engine tests will be skipped"

engines: $(STAMP) $(MLX_STAMP)
	@if [ -f $(MLX_STAMP) ]; then $(PY) -m harmony_gateway.sim.tiny_model build $(ENGINES) $(MLX_VENV)/bin/python; fi

install: $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/harmony-gateway serve --demo

# The playground's browser tests drive Debian's Chromium through Playwright (never `playwright install`).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then \
			(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
			|| echo "warning: could not install chromium; the browser tests will be skipped"; \
		else echo "warning: chromium is missing and installing it needs root:" \
			"run 'sudo apt-get install -y chromium'; the browser tests will be skipped"; fi; }

# The DNS discovery tests run a real DNS server: Debian's dnsmasq, as a child process on a loopback port
# (dnsmasq-base: the program without the system service).
dnsmasq:
	@command -v dnsmasq >/dev/null 2>&1 || test -x /usr/sbin/dnsmasq || { \
		if [ "$$(id -u)" = 0 ]; then \
			(apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y dnsmasq-base) \
			|| echo "warning: could not install dnsmasq; the DNS discovery tests will be skipped (failed under CI)"; \
		else echo "warning: dnsmasq is missing and installing it needs root:" \
			"run 'sudo apt-get install -y dnsmasq-base'; the DNS discovery tests will be skipped (failed under CI)"; fi; }

# The engine set-up (minutes on a fresh machine, nothing once cached) runs beside the rest of the suite;
# the real-engine tests run once it is done.
test: $(STAMP) $(TOOLS_STAMP) chromium dnsmasq
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	@mkdir -p $(ENGINES)
	@$(MAKE) --no-print-directory engines > $(ENGINES)/setup.log 2>&1 & setup=$$!; \
	PATH="$(CURDIR)/.tools/node_modules/.bin:$$PATH" $(PY) -m pytest -q tests --ignore=tests/real_engines; \
	status=$$?; wait $$setup; cat $(ENGINES)/setup.log; \
	$(PY) -m pytest -q tests/real_engines || status=1; exit $$status

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
