"""The `pdserve` command line: wires the packages together, nothing more."""

from __future__ import annotations

import argparse
import sys

# What a node front or a router imports after its command is parsed: a zygote that forks these
# processes (the tests' node zygote, tests/conftest.py) imports it once (about 1.7 s of CPU here).
# No torch: a node front never imports it.
ZYGOTE_PRELOAD = (
    "pdserve.runtime.serve",
    "pdserve.runtime.front.process",
    "pdserve.runtime.front.http_app",
    "pdserve.runtime.front.metrics",
    "pdserve.engine.model.loader",
    "pdserve.engine.model.tokenizer",
    "pdserve.prefill_node.serve",
    "pdserve.prefill_node.front",
    "pdserve.decode_node.serve",
    "pdserve.decode_node.front",
    "pdserve.elastic_node.serve",
    "pdserve.elastic_node.front",
    "pdserve.router.cli",
    "pdserve.router.app",
    "pdserve.infra.tracing",
    "transformers.tokenization_utils_fast",
)


def _generate(cfg, prompts: list[str] | None, max_tokens: int, level: str) -> int:
    """Offline generation with the engine in this process (a smoke test of a model)."""
    from pdserve.engine.core import SamplingParams
    from pdserve.engine.engine import Engine
    from pdserve.infra.logs import setup_logging

    setup_logging("[generate]", level)
    eng = Engine(cfg)
    prompts = prompts or ["What is the capital of France?", "Write a haiku about pipelines."]
    msgs = [
        eng.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]
    ids = [eng.tokenizer(m, add_special_tokens=False)["input_ids"] for m in msgs]
    outs = eng.generate(ids, SamplingParams(max_tokens=max_tokens))
    for p, o in zip(prompts, outs, strict=True):
        n, finish = len(o.token_ids), o.finish_reason.kind
        print(f"### {p}\n{o.text.strip()}\n[{n} tokens, finish={finish}]\n")
    return 0


def _router(args) -> int:
    from pdserve.router.cli import router_config_from_args, serve

    try:
        cfg = router_config_from_args(args)
    except ValueError as e:
        print(f"pdserve router: error: {e}", file=sys.stderr)
        return 2
    serve(cfg)
    return 0


def _light_bench():
    from pdserve.bench.main import add_bench_args, bench_main

    return add_bench_args, bench_main, "a load client for any OpenAI-compatible endpoint"


def _up(argv: list[str]) -> int:
    from pdserve.up import up_main
    from pdserve.up_args import parse_up_args

    return up_main(parse_up_args(argv))


def _light_router():
    from pdserve.router.cli import add_router_args

    return add_router_args, _router, "the OpenAI-compatible PD router"


def _light_trace():
    from pdserve.trace_cmd import add_trace_args, trace_main

    return add_trace_args, trace_main, "one request's stage timeline from the router"


def _light_launch():
    from pdserve.launch import add_launch_args, launch_main

    return add_launch_args, launch_main, "one process of a deployment, its flags from the values"


def _light_register():
    from pdserve.register_cmd import add_register_args, register_main

    return add_register_args, register_main, "a node joins or leaves the routers' worker lists"


# Commands parsed and run without building every subcommand's parser (which imports torch).
LIGHT = {
    "bench": _light_bench,
    "router": _light_router,
    "trace": _light_trace,
    "launch": _light_launch,
    "register": _light_register,
}


def _version() -> str:
    from pdserve.up_args import pdserve_version

    return pdserve_version()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["up"]:  # its own parser: --config, flags passed through (pdserve/up_args.py)
        return _up(argv[1:])
    if argv[:1] and argv[0] in LIGHT:
        # These need none of the model stack: skip importing torch (seconds before the first line).
        add_args, run, desc = LIGHT[argv[0]]()
        ap = argparse.ArgumentParser(prog=f"pdserve {argv[0]}", description=desc)
        add_args(ap)
        return run(ap.parse_args(argv[1:]))
    args = _full_parser().parse_args(argv)
    from pdserve.engine.model.loader import ModelLoadError

    try:
        return _run(args)
    except ModelLoadError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


def _full_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser (importing what they need: torch among it)."""
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Prefill/decode-disaggregated LLM serving"
    )
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True)

    from pdserve.engine.config import EngineConfig
    from pdserve.infra.config_flags import add_flags
    from pdserve.runtime.node_config import NodeConfig, add_node_flags

    g = sub.add_parser("generate", help="offline generation in this process")
    add_flags(g, EngineConfig, defaults={"max_total_tokens": 8192})
    g.add_argument("--prompt", action="append", help="a user message (repeatable)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    g.add_argument("--log-level", default="WARNING", help="this process's log level")

    s = sub.add_parser("serve", help="a colocated PP node (no disaggregation)")
    add_node_flags(s, NodeConfig, port=30000)

    from pdserve.prefill_node.serve import add_prefill_args

    add_prefill_args(sub.add_parser("prefill", help="a prefill node of a PD cluster"))
    from pdserve.decode_node.serve import add_decode_args

    add_decode_args(sub.add_parser("decode", help="a decode node of a PD cluster"))
    from pdserve.router.cli import add_router_args

    add_router_args(sub.add_parser("router", help="the OpenAI-compatible PD router"))

    from pdserve.up_args import add_up_args

    add_up_args(
        sub.add_parser("up", help="a whole local PD cluster: router + prefill + decode nodes")
    )

    from pdserve.bench.main import add_bench_args

    add_bench_args(sub.add_parser("bench", help="a load client for any OpenAI-compatible endpoint"))

    from pdserve.launch import add_launch_args

    add_launch_args(
        sub.add_parser("launch", help="one process of a deployment, its flags from the values")
    )
    sub.add_parser(
        "register", help="a node joins or leaves the routers' worker lists (autoscaling)"
    )
    sub.add_parser("version", help="print the version")
    sub.add_parser("trace", help="one request's stage timeline from the router (pdserve trace ID)")
    return parser


def _node_config(args):
    """The edge of `pdserve serve`, `prefill` and `decode`: their flags as the node's config."""
    from pdserve.pd_common.node_config import PDNodeConfig
    from pdserve.runtime.node_config import NodeConfig, node_config

    return node_config(NodeConfig if args.cmd == "serve" else PDNodeConfig, args)


def _run(args) -> int:
    if args.cmd in ("generate", "serve", "prefill", "decode"):
        from pdserve.engine.config import EngineConfig
        from pdserve.infra.config_flags import config_from_args

        try:
            cfg = (
                config_from_args(EngineConfig, args)
                if args.cmd == "generate"
                else _node_config(args)
            )
        except ValueError as e:
            print(f"pdserve {args.cmd}: error: {e}", file=sys.stderr)
            return 2
    if args.cmd == "generate":
        return _generate(cfg, args.prompt, args.max_tokens, args.log_level)
    if args.cmd == "serve":
        from pdserve.runtime.serve import serve_main

        return serve_main(cfg)
    if args.cmd in ("prefill", "decode") and cfg.elastic:
        from pdserve.elastic_node.serve import elastic_main

        return elastic_main(cfg, args.cmd)
    if args.cmd == "prefill":
        from pdserve.prefill_node.serve import prefill_main

        return prefill_main(cfg)
    if args.cmd == "decode":
        from pdserve.decode_node.serve import decode_main

        return decode_main(cfg)
    if args.cmd == "router":
        return _router(args)
    if args.cmd == "bench":
        from pdserve.bench.main import bench_main

        return bench_main(args)
    if args.cmd == "version":
        print(_version())
    return 0


if __name__ == "__main__":
    sys.exit(main())
