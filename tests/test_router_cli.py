"""`pdserve router`'s command line, generated from RouterConfig (router/config.py through
infra/config_flags.py): the flags users, `pdserve up`, `pdserve launch` and the chart pass, each
with help, each setting exactly its own field, defaults from the config or PDSERVE_ROUTER_<FLAG>,
and vLLM's spellings where the meaning is the same."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from pdserve.infra.config_flags import settings_of
from pdserve.router.cli import ENV_PREFIX, add_router_args, router_config_from_args
from pdserve.router.config import POLICY_NAMES, RouterConfig

# Every spelling the hand-written parser had (and pdserve/up.py, pdserve/launch.py, deploy/ and
# the docs pass), plus vLLM's --scheduling-policy.
FLAGS = {
    *("--prefill", "--decode", "--worker", "--policy", "--insecure", "--host", "--port"),
    *("--api-key", "--served-model-name", "--max-concurrent", "--max-queue", "--queue-timeout"),
    *("--retry-after", "--connect-timeout", "--request-timeout", "--stream-idle-timeout"),
    *("--sse-keepalive", "--max-body-bytes", "--otlp-traces-endpoint", "--debug-requests"),
    *("--log-level", "--log-format", "--health-interval", "--health-timeout"),
    *("--health-failure-threshold", "--health-success-threshold", "--cb-failure-threshold"),
    *("--cb-success-threshold", "--cb-open-seconds", "--pair-failure-threshold"),
    *("--pair-open-seconds", "--max-retries", "--max-migrations", "--retry-initial-backoff"),
    *("--retry-max-backoff", "--prefill-policy", "--decode-policy", "--cache-threshold"),
    *("--balance-abs-threshold", "--balance-rel-threshold", "--disagg-min-prompt-tokens"),
    *("--disagg-decode-prefix-fraction", "--disagg-local-prefill-cost"),
    *("--disagg-idle-local-prefill-cost", "--disagg-transfer-overhead-tokens"),
    "--disagg-stream-delay-weight",
    *("--disagg-fixed-costs", "--ttft-slo-ms", "--itl-slo-ms", "--tenant-max-concurrent"),
    *("--max-queued-prompt-tokens", "--tenant-keys", "--priority-scheduling", "--elastic"),
    *("--elastic-ttft-target-ms", "--elastic-itl-target-ms", "--elastic-sustain"),
    *("--elastic-dwell", "--elastic-flip-grace", "--scheduling-policy"),
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No PDSERVE_ROUTER_* (tests/conftest.py sets some), API key or cluster secret."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX) or name.startswith("PDSERVE_INTERNAL_TOKEN"):
            monkeypatch.delenv(name)
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)


def parser() -> argparse.ArgumentParser:
    return add_router_args(argparse.ArgumentParser(prog="pdserve router"))


def parse(*argv: str) -> RouterConfig:
    return router_config_from_args(parser().parse_args(argv))


def leaves(cfg) -> dict[str, object]:
    """{"health.interval_s": 10.0, ...}: every field, nested ones by path."""
    out: dict[str, object] = {}
    for name, value in dataclasses.asdict(cfg).items():
        if isinstance(value, dict):
            out |= {f"{name}.{k}": v for k, v in value.items()}
        else:
            out[name] = value
    return out


def test_every_flag_has_help_and_the_spellings_are_kept():
    actions = [a for a in parser()._actions if a.dest != "help"]
    for action in actions:
        assert (action.help or "").strip(), action.option_strings
    assert {s for a in actions for s in a.option_strings} == FLAGS


def test_the_defaults_are_the_config():
    assert parse() == RouterConfig()


def other_value(entry) -> str:
    """A valid command-line value for the setting, other than its default."""
    if entry.spec.choices:
        return next(str(c) for c in entry.spec.choices if c != entry.default)
    if entry.kind is bool:
        return "false" if entry.default else "true"
    if entry.kind is str:
        return {"host": "127.0.0.2", "log_level": "debug"}.get(entry.name, "x")
    return str(entry.kind(entry.default * 2 + 1))


def test_each_flag_sets_its_own_field_alone():
    base = leaves(RouterConfig())
    entries = [e for _, e in settings_of(RouterConfig, ENV_PREFIX)]
    assert len(entries) == len(FLAGS) - 6  # not the workers, --policy, --insecure, vLLM's alias
    for entry in entries:
        flag, raw = entry.spec.names(entry.name)[0], other_value(entry)
        changed = {
            k: v for k, v in leaves(parse(flag, raw)).items() if v != base[k] and k != "workers"
        }
        assert len(changed) == 1, (flag, changed)
        [value] = changed.values()
        assert str(value).lower() == raw.lower() or value == entry.kind(raw), (flag, value)


def test_policy_sets_both_and_the_names_are_the_policies():
    from pdserve.router.routing.policies import POLICIES

    assert tuple(POLICIES) == POLICY_NAMES
    cfg = parse("--policy", "random", "--prefill-policy", "round_robin")
    assert cfg.prefill_policy == cfg.decode_policy == "random"
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        RouterConfig(decode_policy="nope")


@pytest.mark.parametrize(
    "argv, on",
    [
        (["--elastic"], True),
        (["--elastic", "true"], True),
        (["--elastic", "false"], False),
        (["--elastic", "--prefill", "http://a:1", "--decode", "http://b:1"], True),  # pdserve up
        ([], False),
    ],
)
def test_elastic_takes_an_optional_true_or_false(argv, on):
    assert parse(*argv).elastic.enabled is on


def test_switches_with_a_word_and_vllms_scheduling_policy():
    assert parse("--disagg-fixed-costs").disagg.fixed_costs
    assert not parse("--disagg-fixed-costs", "no").disagg.fixed_costs
    assert parse("--priority-scheduling").fairness.priority_scheduling
    assert parse("--scheduling-policy", "priority").fairness.priority_scheduling
    assert not parse("--scheduling-policy", "fcfs").fairness.priority_scheduling
    with pytest.raises(SystemExit):
        parser().parse_args(["--scheduling-policy", "lifo"])


def test_an_environment_variable_sets_a_default_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv("PDSERVE_ROUTER_QUEUE_TIMEOUT", "7.5")
    monkeypatch.setenv("PDSERVE_ROUTER_CB_OPEN_SECONDS", "9")
    monkeypatch.setenv("PDSERVE_ROUTER_PAIR_OPEN_SECONDS", "2")
    monkeypatch.setenv("PDSERVE_ROUTER_ELASTIC", "true")
    monkeypatch.setenv("PDSERVE_ROUTER_POLICY", "least_load")
    cfg = parse()
    assert cfg.queue_timeout_s == 7.5 and cfg.breaker.open_s == 9 and cfg.pair_breaker.open_s == 2
    assert cfg.elastic.enabled and cfg.prefill_policy == cfg.decode_policy == "least_load"
    assert "PDSERVE_ROUTER_QUEUE_TIMEOUT" in parser().format_help()
    assert parse("--queue-timeout", "1").queue_timeout_s == 1


@pytest.mark.parametrize(
    "name, raw",
    [
        ("PDSERVE_ROUTER_MAX_QUEUE", "lots"),
        ("PDSERVE_ROUTER_DISAGG_FIXED_COSTS", "maybe"),
        ("PDSERVE_ROUTER_LOG_FORMAT", "xml"),
        ("PDSERVE_ROUTER_POLICY", "fastest"),
    ],
)
def test_a_bad_environment_value_names_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(SystemExit, match=f"{name}='{raw}'"):
        parser()


def test_the_api_key_reads_its_own_variable_and_stays_out_of_help(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-not-for-help")
    assert parse().api_key == "sk-not-for-help"
    assert "sk-not-for-help" not in parser().format_help()
    assert parse("--api-key", "").api_key is None
    assert parse("--otlp-traces-endpoint", "").otlp_traces_endpoint is None
