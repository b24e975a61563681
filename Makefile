# Each target does its own set-up from nothing; re-running is cheap (a stamp file tracks pyproject.toml).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install lint clean trace-schema

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# No GPU here: a CPU torch build must go in first, or pip pulls a multi-GB CUDA build.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q torch triton; \
	else \
	  $(BIN)/python -m pip install -q torch==2.13.0 triton==3.8.0; \
	fi
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	cd /tmp && $(CURDIR)/$(BIN)/replayllm generate --enable-trace-replay --demo

# Two passes: every module not marked `serial` on $(JOBS) pytest-xdist workers (whole modules per worker, see
# tests/conftest.py), then the `serial` ones alone, so no neighbour's load skews what they time. Exit status: the
# first failure's; 5 (nothing collected) only when neither pass collected a test.
JOBS ?= 2
# The second pass collects only the files that hold `serial` tests (collecting the whole suite costs ~20 s).
SERIAL_FILES = $(shell grep -rl --include='test_*.py' "pytest.mark.serial" tests)
test: $(STAMP)
	@$(BIN)/python -m pytest -q -n $(JOBS) -m "not serial" $(PYTEST_ARGS); a=$$?; \
	$(BIN)/python -m pytest -q -m serial $(or $(PYTEST_ARGS),$(SERIAL_FILES)); b=$$?; \
	r=0; for c in $$a $$b; do if [ $$r -eq 0 ] && [ $$c -ne 0 ] && [ $$c -ne 5 ]; then r=$$c; fi; done; \
	if [ $$a -eq 5 ] && [ $$b -eq 5 ]; then r=5; fi; exit $$r

# The floor report (folder arrows, two-way pairs, cycles; exit 1 on a cycle) when the shared tool is there;
# tests/repo/test_import_floors.py checks the same rules either way.
FLOORS_TOOL := ../shared/tools/import_floors.py

lint: $(STAMP)
	$(BIN)/ruff check .
	@if [ -f $(FLOORS_TOOL) ]; then $(PY) $(FLOORS_TOOL); else echo "$(FLOORS_TOOL) not found: floor report skipped"; fi

# docs/trace_file.schema.json from the pydantic models (entrypoints/diff/trace_schema.py); a test checks it.
trace-schema: $(STAMP)
	$(BIN)/python -c "from replayllm.entrypoints.diff.trace_schema import schema_text; \
	  open('docs/trace_file.schema.json', 'w').write(schema_text())"

clean:
	rm -rf $(VENV) build *.egg-info
