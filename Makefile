VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup serve test test-heavy bench clean

setup:
	bash scripts/setup.sh

# The main job: a whole local PD cluster on the default model.
serve: setup
	$(VENV)/bin/pdserve up

# The test suite (what CI runs).
test: setup
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
