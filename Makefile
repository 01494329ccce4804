VENV ?= .venv
PYTEST_ARGS ?=
SOAK_ARGS ?=

.PHONY: setup setup-test serve test bench soak clean

setup:
	VENV=$(VENV) bash scripts/setup.sh

# Also aiperf (own venv under $(VENV)/aiperf), which one test compares `pdserve bench` with.
setup-test:
	VENV=$(VENV) bash scripts/setup.sh --test

# The main job: a whole local PD cluster on the default model.
serve: setup
	$(VENV)/bin/pdserve up

# The test suite (what CI runs).
test: setup-test
	PDSERVE_AIPERF=$(abspath $(VENV))/aiperf/bin/aiperf $(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# Opt-in, not part of `test`: `pdserve up` under streaming load with cancellations for 10 minutes,
# RSS and open fds of every process sampled; fails on growth. E.g. SOAK_ARGS="--model DIR --duration 180".
soak: setup
	$(VENV)/bin/python bench/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
