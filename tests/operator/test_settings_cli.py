"""Operator and router settings from env and flags, the CLIs' --help, status rendering and the work queue."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from lorafleet_operator import cli as operator_cli
from lorafleet_operator import status as st
from lorafleet_operator.settings import OperatorSettings
from lorafleet_operator.workqueue import WorkQueue
from lorafleet_router import cli as router_cli
from lorafleet_router.settings import RouterSettings


def parse(argv: list[str], env: dict[str, str]) -> OperatorSettings:
    parser = argparse.ArgumentParser()
    OperatorSettings.add_arguments(parser)
    return OperatorSettings.from_sources(env, parser.parse_args(argv))


def parse_router(argv: list[str], env: dict[str, str]) -> RouterSettings:
    parser = argparse.ArgumentParser()
    RouterSettings.add_arguments(parser)
    return RouterSettings.from_sources(env, parser.parse_args(argv))


def test_defaults_env_then_flags(tmp_path: Path) -> None:
    assert parse([], {}).default_replicas == 2
    assert parse([], {"LORAFLEET_DEFAULT_REPLICAS": "3"}).default_replicas == 3
    s = parse(["--default-replicas", "4", "-n", "a,b", "--namespace", "c"], {"LORAFLEET_DEFAULT_REPLICAS": "3"})
    assert s.default_replicas == 4 and s.namespaces == ("a", "b", "c")
    assert parse(["--all-namespaces"], {}).all_namespaces
    assert parse([], {"LORAFLEET_ALL_NAMESPACES": "true"}).all_namespaces
    token = tmp_path / "token"
    token.write_text("from-file\n")
    s = parse(["--admin-token-file", str(token)], {"LORAFLEET_ADMIN_TOKEN": "from-env"})
    assert s.token() == "from-file"
    assert parse([], {"LORAFLEET_ADMIN_TOKEN": "from-env"}).token() == "from-env"
    assert "from-env" not in repr(parse([], {"LORAFLEET_ADMIN_TOKEN": "from-env"}))


def test_bad_values_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="LORAFLEET_DEFAULT_REPLICAS"):
        parse([], {"LORAFLEET_DEFAULT_REPLICAS": "two"})
    with pytest.raises(ValueError, match="replicas"):
        parse(["--default-replicas", "0"], {})
    with pytest.raises(ValueError, match="--balance"):
        parse(["--balance", "sometimes"], {})
    with pytest.raises(ValueError, match="--balance-epsilon"):
        parse([], {"LORAFLEET_BALANCE_EPSILON": "-0.5"})


def test_router_settings_from_env_then_flags() -> None:
    s = parse_router([], {})
    assert (s.router_port, s.inference_port, s.router_policy, s.demand_window) == (8000, 8000, "cache-aware", 30.0)
    s = parse_router(
        ["--router-port", "9000", "-n", "a"], {"LORAFLEET_ROUTER_PORT": "7000", "LORAFLEET_DEMAND_WINDOW": "5"}
    )
    assert (s.router_port, s.namespaces, s.demand_window) == (9000, ("a",), 5.0)
    assert parse_router([], {"LORAFLEET_ALL_NAMESPACES": "1"}).all_namespaces
    with pytest.raises(ValueError, match="demand window"):
        parse_router(["--demand-window", "0"], {})
    with pytest.raises(ValueError, match="LORAFLEET_ROUTER_TIMEOUT"):
        parse_router([], {"LORAFLEET_ROUTER_TIMEOUT": "soon"})


def test_each_process_has_its_own_flags_and_env() -> None:
    """The operator and the router share only the watched namespaces (and the listen address's name);
    every other flag belongs to one of them, under the name and variable it always had."""

    def flags(parser: argparse.ArgumentParser) -> set[str]:
        return {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help", "--verbose"}

    operator, router = flags(operator_cli.build_parser()), flags(router_cli.build_parser())
    assert operator & router == {"--namespace", "--all-namespaces", "--bind-host"}
    assert {"--router-port", "--router-policy", "--demand-window", "--inference-port"} <= router - operator
    assert {"--default-replicas", "--store-bucket", "--demand-urls", "--leader-elect"} <= operator - router
    env = {f.metadata["env"] for cls in (OperatorSettings, RouterSettings) for f in dataclasses.fields(cls)}
    assert {"LORAFLEET_ROUTER_PORT", "LORAFLEET_DEMAND_WINDOW", "LORAFLEET_DEFAULT_REPLICAS"} <= env
    assert all(e.startswith("LORAFLEET_") for e in env)


def test_balance_defaults_to_autoscaled_adapters_with_epsilon_a_quarter() -> None:
    s = parse([], {})
    assert (s.balance, s.balance_epsilon) == ("autoscaled", 0.25)
    s = parse(["--balance", "all", "--balance-epsilon", "0.1"], {"LORAFLEET_BALANCE": "off"})
    assert (s.balance, s.balance_epsilon) == ("all", 0.1)
    assert parse([], {"LORAFLEET_BALANCE": "off"}).balance == "off"


@pytest.mark.parametrize("prog", ["lorafleet-operator", "lorafleet-router"])
def test_help(prog: str) -> None:
    out = subprocess.run([Path(sys.executable).parent / prog, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--namespace" in out.stdout and "--all-namespaces" in out.stdout
    if prog == "lorafleet-operator":
        for flag in ("--default-replicas", "--store-bucket", "--admin-token-file", "--liveness-port", "--peering"):
            assert flag in out.stdout
        assert "--balance BALANCE" in out.stdout and "--balance-epsilon BALANCE_EPSILON" in out.stdout
        assert "LORAFLEET_BALANCE_EPSILON" in " ".join(out.stdout.split())
        assert "LORAFLEET_DEFAULT_REPLICAS" in out.stdout
    else:
        assert "--router-port" in out.stdout and "--store-bucket" not in out.stdout


def test_render_keeps_transition_time_until_status_changes() -> None:
    ok = st.Condition("EndpointsReady", True, st.ALL_LOADED, "2/2")
    synced = st.Condition("Synced", True, st.SOURCE_AVAILABLE, "direct")
    observed = st.Observed(
        1, st.READY, synced, ok, [{"address": "a", "podName": "p", "ready": True}], ["p"], "s3://b/x"
    )
    first = st.render(observed, {}, now="2026-01-01T00:00:00Z")
    again = st.render(observed, first, now="2026-01-01T00:05:00Z")
    assert st.status_patch(again, first) == {}
    bad = st.Condition("EndpointsReady", False, st.PARTIALLY_LOADED, "1/2")
    observed.endpoints_ready, observed.phase = bad, st.DEGRADED
    changed = st.render(observed, first, now="2026-01-01T00:09:00Z")
    times = {c["type"]: c["lastTransitionTime"] for c in changed["conditions"]}
    assert times == {"Synced": "2026-01-01T00:00:00Z", "EndpointsReady": "2026-01-01T00:09:00Z",
                     "Degraded": "2026-01-01T00:00:00Z", "Ready": "2026-01-01T00:09:00Z"}  # fmt: skip
    ready = st.condition(changed, "Ready")
    assert ready is not None and ready["reason"] == "PartiallyLoaded" and ready["status"] == "False"
    assert st.status_patch({"revision": None, "phase": "Ready"}, {"revision": "x", "phase": "Ready"}) == {
        "revision": None
    }


async def test_workqueue_dedupes_and_requeues_dirty_keys() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    q.add("a")
    q.add("b")
    assert len(q) == 2
    key = await q.get()
    assert key == "a"
    q.add("a")  # while processing: not handed out twice
    assert await q.get() == "b"
    assert len(q) == 0
    q.done("a")  # dirty -> queued again
    assert await q.get() == "a"
    q.done("a")
    q.done("b")
    q.add_after("c", 0.05)
    q.add_after("c", 10)  # the earlier timer wins
    assert await asyncio.wait_for(q.get(), 2) == "c"
    q.done("c")
    assert q.idle()


def test_operator_package_never_imports_torch_or_the_worker() -> None:
    code = (
        "import sys, importlib, pkgutil, lorafleet_operator\n"
        "for m in pkgutil.iter_modules(lorafleet_operator.__path__):\n"
        "    importlib.import_module('lorafleet_operator.' + m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'lorafleet_worker', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
