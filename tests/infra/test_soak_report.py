"""The chaos soak's report (tools/soak_report.py) and schedule (tools/soak.py): outcomes per second,
per-object convergence, the plot, the seeded fault rounds, what counts as a converged object."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> ModuleType:
    """Import tools/<name>.py (tools/ is not a package) as `lorafleet_<name>`."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location(f"lorafleet_{name}", ROOT / "tools" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


REPORT = _tool("soak_report")


def outcome(ended: float, stream: bool, result: str = "ok") -> dict[str, object]:
    return {"started": ended - 0.5, "ended": ended, "adapter": "a", "stream": stream, "router": "r", "result": result}


def test_outcomes_are_counted_in_the_second_they_ended() -> None:
    outcomes = [outcome(0.2, False), outcome(0.9, True), outcome(1.5, False, "http-500"), outcome(2.99, True, "broken")]
    series = REPORT.outcome_series(outcomes, 3)
    assert series == {
        "plain:ok": [1, 0, 0],
        "plain:failed": [0, 1, 0],
        "stream:ok": [1, 0, 0],
        "stream:failed": [0, 0, 1],
    }
    assert REPORT.outcome_series([outcome(7.0, False)], 3)["plain:ok"] == [0, 0, 1]  # past the end: the last second


def test_convergence_time_is_from_when_an_object_stayed_converged() -> None:
    samples = [
        {"t": 0.0, "ok": {"a": True, "b": True, "c": True}},
        {"t": 10.0, "ok": {"a": False, "b": True, "c": False}},
        {"t": 12.0, "ok": None},  # the API server was down: no evidence either way
        {"t": 14.0, "ok": {"a": True, "b": False, "c": False}},
        {"t": 15.0, "ok": {"a": None, "b": False, "c": False}},  # a could not be judged: no evidence
        {"t": 16.0, "ok": {"a": True, "b": True, "c": False}},
        {"t": 18.0, "ok": {"a": True, "b": True, "d": True}},  # c deleted, d created
    ]
    times = REPORT.convergence_times(samples, since=11.0)
    assert times == {"a": 3.0, "b": 5.0, "d": 7.0}
    samples[-1]["ok"]["b"] = False
    assert REPORT.convergence_times(samples, since=11.0)["b"] is None  # not converged at the end
    assert REPORT.convergence_times(samples, since=20.0)["a"] == 0.0  # converged before `since`
    assert REPORT.convergence_times([{"t": 1.0, "ok": None}], since=0.0) == {}


def test_timeline_plot_is_written(tmp_path: Path) -> None:
    outcomes = [outcome(float(t), t % 2 == 0, "ok" if t % 5 else "broken") for t in range(20)]
    samples = [{"t": float(t), "ok": {"a": t > 8, "b": True}} for t in range(0, 20, 2)]
    report = {
        "seed": 7,
        "faults": [
            {"at": 5.0, "ended": 9.0, "kind": "minio-down", "target": "m"},
            {"at": 12.0, "ended": 12.1, "kind": "worker-kill", "target": "w"},
        ],
        "outcomes_per_second": REPORT.outcome_series(outcomes, 20),
        "convergence": {"last_fault_ended": 12.1, "samples": samples},
        "timeline": outcomes,
    }
    assert REPORT.seconds_of(report) == 20
    png = tmp_path / "timeline.png"
    REPORT.plot_timeline(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_schedule_runs_every_kind_once_per_round_in_a_seeded_order() -> None:
    import random

    soak = _tool("soak")
    args = soak.parse_args(["--minutes", "6", "--fault-every", "20", "--seed", "5"])
    plan = soak.schedule(args, random.Random(5))
    assert len(plan) == 2 * len(soak.FAULTS)  # 18 slots: two full rounds
    assert sorted(plan[: len(soak.FAULTS)]) == sorted(soak.FAULTS) == sorted(plan[len(soak.FAULTS) :])
    assert plan == soak.schedule(args, random.Random(5)) and plan != soak.schedule(args, random.Random(6))
    few = soak.parse_args(["--faults", "minio-down,apiserver-restart", "--minutes", "1", "--fault-every", "30"])
    assert sorted(soak.schedule(few, random.Random(1))) == ["apiserver-restart", "minio-down"]


def test_a_model_is_ok_when_ready_on_the_endpoints_it_asks_for() -> None:
    soak = _tool("soak")

    def dm(spec: dict[str, object], ready: int, total: int, generation: int = 1) -> dict[str, object]:
        status = {"phase": "Ready", "observedGeneration": 1, "readyEndpoints": ready, "totalEndpoints": total}
        return {"metadata": {"generation": generation}, "spec": spec, "status": status}

    assert soak.model_ok(dm({}, 2, 2)) and not soak.model_ok(dm({}, 1, 1))  # default replicas: 2
    assert soak.model_ok(dm({"replicas": 1}, 1, 1)) and not soak.model_ok(dm({"replicas": 2}, 1, 2))
    assert not soak.model_ok(dm({"replicas": 1}, 1, 1, generation=2))  # the status is for an older spec
    scaled = {"autoscaling": {"minReplicas": 1, "maxReplicas": 3, "target": 2}}
    assert soak.model_ok(dm(scaled, 1, 1)) and soak.model_ok(dm(scaled, 3, 3))
    assert not soak.model_ok(dm(scaled, 4, 4)) and not soak.model_ok(dm(scaled, 0, 0))


def test_a_broken_stream_is_explained_only_by_a_kill_while_it_was_in_flight() -> None:
    broken = {"started": 10.0, "ended": 12.0, "adapter": "a", "stream": True, "router": "r", "result": "broken"}
    kill = {"at": 11.0, "ended": 11.1, "kind": "worker-kill", "target": "w"}
    assert REPORT.unexplained_breaks([broken], [kill]) == []
    assert REPORT.unexplained_breaks([broken], [{**kill, "at": 13.5}]) == []  # seen by the client within the slack
    assert REPORT.unexplained_breaks([broken], [{**kill, "at": 20.0, "ended": 20.2}]) == [broken]  # after it ended
    # a pod deletion under way when the stream started (the router had not seen it yet): its victim
    assert REPORT.unexplained_breaks([broken], [{**kill, "kind": "pod-delete", "at": 9.8, "ended": 10.1}]) == []
    # one that was over before the stream started: not
    assert REPORT.unexplained_breaks([broken], [{**kill, "kind": "pod-delete", "at": 9.0, "ended": 9.5}]) == [broken]
    assert REPORT.unexplained_breaks([broken], [{**kill, "kind": "apiserver-restart"}]) == [broken]  # not a kill
    plain = {**broken, "stream": False}
    assert REPORT.unexplained_breaks([plain, {**broken, "result": "ok"}], []) == []  # only failed streams count


def test_a_flap_is_an_object_unconverged_after_everything_had_converged() -> None:
    samples = [
        {"t": 5.0, "ok": {"a": False, "b": True}},  # before convergence: not a flap
        {"t": 10.0, "ok": {"a": True, "b": True}},
        {"t": 13.0, "ok": None},
        {"t": 16.0, "ok": {"a": True, "b": False}},
        {"t": 19.0, "ok": {"a": None, "b": True}},  # unjudged is not a flap
    ]
    assert REPORT.flaps(samples, since=10.0) == [{"t": 16.0, "not_converged": ["b"]}]
    assert REPORT.flaps(samples[:3], since=10.0) == []


def test_the_verdict_line_names_each_failed_invariant_with_its_figures() -> None:
    soak = _tool("soak")
    held = {"tracebacks": {"ok": True, "by_pod": {}}, "rss": {"ok": True, "growth_mib": {"w": 3}}}
    assert soak.verdict(held) == "soak: every invariant held (tracebacks, rss)"
    failed = {**held, "converged": {"ok": False, "seconds_after_last_fault": None, "state": "a03 not Ready",
                                    "flaps_after_convergence": [{"t": 1}]}}  # fmt: skip
    line = soak.verdict(failed)
    assert line.startswith("soak: FAILED converged ")
    assert "a03 not Ready" in line and "seconds_after_last_fault" in line and "flaps_after_convergence" in line
    assert "tracebacks" not in line
    assert len(soak.verdict(failed, width=40)) < len("soak: FAILED converged ") + 41
