import os
import random

import pytest
from tiny_model import build_tiny_model

from pdserve.consensus import rank_checker

RANK_MODULES = [
    "pdserve.runtime.rank.process",
    "pdserve.prefill_node.rank",
    "pdserve.decode_node.rank",
]

# The rank consensus checker is on in the test process (the in-process clusters of tests/inproc.py
# compare every rank's decisions) and in every rank the tests start as a process.
rank_checker.enable()
os.environ[rank_checker.ENV] = "1"

# Routers the tests start as processes (`pdserve up`, `pdserve router`) send every request that can
# use a PD pair through it, so the PD tests exercise the KV transfer whatever their prompt length;
# a test of conditional disaggregation passes its own --disagg-* flags, which win over these.
os.environ.setdefault("PDSERVE_ROUTER_DISAGG_MIN_PROMPT_TOKENS", "0")
os.environ.setdefault("PDSERVE_ROUTER_DISAGG_DECODE_PREFIX_FRACTION", "2")
os.environ.setdefault("PDSERVE_ROUTER_DISAGG_LOCAL_PREFILL_COST", "0")


def _one_default_tls_context() -> None:
    """The tests talk plain HTTP to loopback, yet every `httpx.get` (and every client built without
    `verify=`) builds a TLS context and loads certifi's CA bundle into it: about 75 ms of CPU each,
    and the tests poll health, stats and metrics thousands of times. In the test processes only,
    the default context (verify=True, no client certificate) is built once and shared."""
    import functools

    from httpx._transports import default

    make = default.create_ssl_context
    shared = functools.cache(lambda trust_env: make(verify=True, cert=None, trust_env=trust_env))

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None:
            return shared(trust_env)
        return make(verify=verify, cert=cert, trust_env=trust_env)

    default.create_ssl_context = create_ssl_context


_one_default_tls_context()


@pytest.fixture(scope="session", autouse=True)
def process_tmpdir(tmp_path_factory):
    """Every process the tests start makes its temporary folders (a front's socket folder, a rank
    zygote's) under this session's pytest folder, not /tmp. A process that cleans up removes them
    (tests/test_pp_node.py checks SIGTERM); one a test kills with SIGKILL cannot, and what it
    leaves goes with pytest's old session folders instead of piling up in /tmp."""
    import tempfile

    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # re-read TMPDIR
    yield
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """GGUF metadata and tokenizer caches (engine/model/gguf_file.py) go to a fresh folder per
    session: the first load of a GGUF in a session parses it like on a new machine, and ~/.cache
    stays clean."""
    old = os.environ.get("PDSERVE_CACHE_DIR")
    os.environ["PDSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("pdserve-cache"))
    yield
    if old is None:
        os.environ.pop("PDSERVE_CACHE_DIR", None)
    else:
        os.environ["PDSERVE_CACHE_DIR"] = old


@pytest.fixture(scope="session", autouse=True)
def rank_zygote(process_tmpdir):
    """One rank zygote per test process (infra/zygote.py), named in the environment that every
    node the tests start inherits: each rank is forked from it instead of importing torch again
    (about 3.5 s of CPU per rank on the 2-core machine, 96 ranks per run). `pdserve up` starts
    its own, as in production; a node started without one starts its own too."""
    from pdserve.infra.zygote import ENV
    from pdserve.infra.zygote_client import Zygote

    zygote = Zygote.start(RANK_MODULES)
    os.environ[ENV] = zygote.path
    yield zygote
    os.environ.pop(ENV, None)
    zygote.close()


@pytest.fixture(scope="session", autouse=True)
def node_zygote(process_tmpdir):
    """One zygote per test process for the node and router processes the tests start
    (tests/cluster.py start): `pdserve.cli` and what a front or router imports once it runs
    (pdserve/cli.py ZYGOTE_PRELOAD, about 1.7 s of CPU per process here), never torch. Each is
    forked into a process group of its own, with its own environment and log file, and runs
    `pdserve.cli.main(argv)` as `python -m pdserve.cli argv` would."""
    import cluster

    from pdserve.infra.zygote_client import Zygote

    zygote = Zygote.start(["pdserve.cli"])
    cluster.NODE_ZYGOTE = zygote
    yield zygote
    cluster.NODE_ZYGOTE = None
    zygote.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """4 layers, hidden 64: the default test model."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny4"), num_layers=4)


@pytest.fixture(scope="session")
def tiny30(tmp_path_factory):
    """30 layers like SmolLM2 (so PP splits are the real ones), hidden 64."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny30"), num_layers=30, seed=1)


@pytest.fixture(scope="session")
def tiny6(tmp_path_factory):
    """6 layers, hidden 64: whole-cluster load tests (abort storm, faults, bench tool), where the
    per-request work (not the layer split) sets the run time; 6 still splits over 2 and 3 ranks
    with the cross-rank overlaps of the real layouts (prefill 2/2/2 against decode 3/3)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny6"), num_layers=6, seed=1)


@pytest.fixture(scope="session")
def gemma6(tmp_path_factory):
    """A tiny random Gemma 3 of 6 layers (tests/tiny_model.py): a sliding window of 7 tokens on
    four of them, GeGLU, four norms a layer, scaled embeddings, tied."""
    return build_tiny_model(
        tmp_path_factory.mktemp("gemma6"), num_layers=6, seed=1, arch="gemma3", tie=True
    )


@pytest.fixture(scope="session")
def gemma6_greedy(gemma6, mixed_prompts):
    """(prompts, transformers' greedy answers) on gemma6, as `tiny6_greedy`."""
    from one_thread import hf_greedy_one_thread

    prompts = [mixed_prompts[i] for i in INPROC_PROMPTS]
    return prompts, hf_greedy_one_thread(gemma6, prompts, INPROC_MAX_NEW)


@pytest.fixture(scope="session")
def mixed_prompts():
    """16 prompts of mixed lengths; with chunk size 16 the long ones take more than two chunks."""
    rng = random.Random(7)
    lengths = [3, 5, 9, 16, 17, 24, 33, 40, 47, 52, 60, 64, 70, 12, 2, 38]
    return [[rng.randrange(3, 380) for _ in range(n)] for n in lengths]


# Prompts of the in-process cluster tests: 3, 16, 17, 47 and 70 tokens (with chunks of 16: one
# chunk, exactly one, one plus a token, three, five).
INPROC_PROMPTS = (0, 3, 4, 8, 12)
INPROC_MAX_NEW = 24


@pytest.fixture(scope="session")
def tiny6_greedy(tiny6, mixed_prompts):
    """(prompts, transformers' greedy answers of INPROC_MAX_NEW tokens) on tiny6, the reference of
    the in-process cluster tests; torch on one thread, several times faster on a busy machine."""
    import torch
    from reference import hf_greedy, load_hf

    prompts = [mixed_prompts[i] for i in INPROC_PROMPTS]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return prompts, hf_greedy(load_hf(tiny6), prompts, INPROC_MAX_NEW)
    finally:
        torch.set_num_threads(threads)


# The slowest files first, slowest at the top (`pytest --durations`, one process): `make test`
# spreads files over pytest-xdist workers in collection order, so the long ones start together and
# the short ones fill in at the end, instead of one long file running alone after the rest are
# done. Order within a file is kept. Only the order matters here; no time is asserted.
SLOWEST_FILES = (
    "test_pd_nodes.py",
    "test_chaos_abort_storm.py",
    "test_chaos_faults.py",
    "test_pp_node.py",
    "test_up.py",
    "test_bench_tool.py",
    "test_openai_choices.py",
    "test_tracing.py",
    "test_model.py",
    "test_control_plane_auth.py",
    "test_router_fuzz.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _kernel_switches_restored():
    """The kernel switches (engine/kernels/switches.py) are the process's: whatever a test sets,
    itself or by building an Engine with EngineConfig(kernels=...), the next test starts from the
    defaults."""
    from pdserve.engine.kernels import switches

    yield
    switches.use(switches.KernelSwitches())


@pytest.fixture
def kernel_switches():
    """`kernel_switches(paged_attention=False)`: the current switches with these changed, for this
    test (the autouse fixture above puts the defaults back)."""
    import dataclasses

    from pdserve.engine.kernels import switches

    def change(**changes: bool):
        now = dataclasses.replace(switches.current(), **changes)
        switches.use(now)
        return now

    return change
