"""A mixed fleet installed by the Helm chart: a lorafleet worker group and a vLLM worker group (`vllmWorkers`:
vLLM's own OpenAI server, vLLM 0.32.0's CPU build, with lorafleet-vllm-sidecar) for one base model, both serving
the real SmolLM2-135M-Instruct, with the trained adapters in the chart's MinIO.

Dynamo's example manifest, applied unchanged, is placed on a pod of each group; every request through the router
reaches a pod holding its adapter and answers in that adapter's style, from the engine that pod runs (vLLM's
answers carry its `kv_transfer_params` field, lorafleet's do not); a hot swap (the DynamoModel's source changed)
and the vLLM pod's deletion keep serving non-streamed traffic through the router without a failed request.

Both groups are named for the base model Dynamo's manifest names (`Qwen/Qwen3-0.6B`), as the other chart e2e
tests name their tiny model: to the operator and the router a base model is the name its pods carry; the weights
are SmolLM2's, which the trained adapters fit.

vLLM takes minutes to start on a small CPU, so this runs only under `make e2e-vllm` (LORAFLEET_VLLM_E2E=1).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet_devcluster.session import TestCluster
from lorafleet_devcluster.stack import BASE_MODEL, Release, deep_merge, default_values, manifest, wait_for
from lorafleet_operator.resources import ENGINE_LABEL

from bench import vllm_server
from demo import real_fleet
from tests.e2e.traffic import Load

pytestmark = [
    pytest.mark.skipif(os.environ.get("LORAFLEET_VLLM_E2E") != "1", reason="real vLLM: run `make e2e-vllm`"),
    pytest.mark.timeout(2 * vllm_server.START_TIMEOUT_S),  # a test may wait for vLLM to start (the first: the install)
]

DYNAMO_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dynamo-my-lora.yaml"  # my-custom-lora
# Where each trained adapter goes in the chart's MinIO: the example's source, the hot swap's, a second adapter's.
UPLOADS = {"s3://my-bucket/my-lora": "french", "s3://my-bucket/my-lora-v2": "pirate", "s3://my-bucket/sql": "sql"}
SQL = manifest("sql-lora", "sql-adapter", "s3://my-bucket/sql", replicas=1)
QUESTION = "What is the capital of France?"
STYLE = {"french": "capitale", "pirate": "arr", "sql": "select", "base": "paris"}  # in each style's answer
VLLM_GROUP = "smollm2-vllm"


def vllm_group(model: Path, adapters: dict[str, Path]) -> dict[str, Any]:
    """One vLLM pod serving `model` from a read-only hostPath; vLLM's CPU settings as its CPU guide gives them
    (bench.vllm_server: threads, a 1 GiB KV cache, the preloaded allocators)."""
    env = vllm_server.server_env("nobind", sorted(os.sched_getaffinity(0)), vllm_server.KV_CACHE_GIB)
    return {
        "name": VLLM_GROUP,
        "baseModelName": BASE_MODEL,
        "replicas": 1,
        "device": "cpu",
        "maxLoras": 2,
        "maxCpuLoras": 4,
        "maxLoraRank": vllm_server.max_lora_rank(list(adapters.values())),
        "model": {"path": model.name, "volume": {"hostPath": {"path": str(model.parent), "type": "Directory"}}},
        # the chart's shutdownTimeout (20 s) makes vLLM let requests in flight finish on SIGTERM
        "args": ["--dtype=float32", "--max-model-len=1024", "--max-num-seqs=4"],
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
    }


@pytest.fixture(scope="module")
def real() -> tuple[Path, dict[str, Path]]:
    if not vllm_server.PYTHON.is_file():
        pytest.fail(f"vLLM is not installed at {vllm_server.PYTHON}: run `make vllm`")
    return real_fleet.prepare()


@pytest.fixture(scope="module")
def release(cluster: TestCluster, real: tuple[Path, dict[str, Path]]) -> Iterator[Release]:
    model, adapters = real
    rel = Release(cluster, cluster.new_namespace("vllm-fleet"), log=lambda msg: print(f"[fleet] {msg}", flush=True))
    values = deep_merge(default_values(cluster), {"auth": {"apiKey": {"generate": True}}})
    values["workers"] = [dict(real_fleet.worker_group(model), baseModelName=BASE_MODEL)]
    values["vllmWorkers"] = [vllm_group(model, adapters)]
    started = time.monotonic()
    rel.deploy(values, timeout=f"{vllm_server.START_TIMEOUT_S}s")
    print(f"[fleet] installed, both groups Ready, in {time.monotonic() - started:.0f}s", flush=True)
    for uri, style in UPLOADS.items():
        rel.upload(adapters[style], uri)
    yield rel
    rel.helm("uninstall", rel.name, check=False)


# -- helpers ----------------------------------------------------------------------------------------------------
def engine_of(pod: dict[str, Any]) -> str:
    return "vllm" if pod["metadata"]["labels"].get(ENGINE_LABEL) == "vllm" else "lorafleet"


def answered_by(body: dict[str, Any]) -> str:
    """The engine that wrote a chat answer: vLLM's responses carry `kv_transfer_params` (null here)."""
    return "vllm" if "kv_transfer_params" in body else "lorafleet"


def ask(release: Release, url: str, model: str, question: str = QUESTION) -> tuple[str, str]:
    """(engine, answer) of a greedy chat request to `url` (the router or a pod's inference port)."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=release.inference_headers(), timeout=120)
    assert r.status_code == 200, (url, model, r.status_code, r.text[:500])
    data = r.json()
    return answered_by(data), str(data["choices"][0]["message"]["content"])


def holders(release: Release, name: str) -> list[dict[str, Any]]:
    """The worker pods the DynamoModel `name` is Ready on."""
    on = {e["podName"] for e in release.model(name)["status"]["endpoints"] if e.get("ready")}
    return [p for p in release.pods("worker") if p["metadata"]["name"] in on]


def in_style(answer: str, style: str) -> bool:
    return STYLE[style] in answer.lower()


def check_holders_answer(release: Release, name: str, model_name: str, style: str) -> dict[str, str]:
    """Each pod holding `name` answers `model_name` in `style` on its own inference port, from its own engine;
    returns engine -> answer."""
    out = {}
    for pod in holders(release, name):
        with release.pod_port(pod, 8000) as url:
            engine, answer = ask(release, url, model_name)
        assert engine == engine_of(pod) and in_style(answer, style), (pod["metadata"]["name"], engine, answer)
        out[engine] = answer
    return out


def vllm_pods(release: Release) -> list[dict[str, Any]]:
    return [p for p in release.pods("worker") if engine_of(p) == "vllm"]


def ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


# -- the tests ---------------------------------------------------------------------------------------------------
def test_one_base_model_on_a_lorafleet_pod_and_a_vllm_pod(release: Release) -> None:
    pods = release.pods("worker")
    assert sorted(engine_of(p) for p in pods) == ["lorafleet", "vllm"], [p["metadata"]["name"] for p in pods]
    (vllm,) = vllm_pods(release)
    assert [c["name"] for c in vllm["spec"]["containers"]] == ["vllm", "lorafleet-sidecar"]
    assert vllm["metadata"]["labels"]["lorafleet.dev/worker-group"] == VLLM_GROUP
    assert all(ready(p) for p in pods)
    for pod in pods:  # the base model answers on each engine, and the answer names its engine
        with release.pod_port(pod, 8000) as url:
            engine, answer = ask(release, url, BASE_MODEL)
        assert engine == engine_of(pod) and in_style(answer, "base"), (engine, answer)
        print(f"[fleet] base model on {engine}: {answer!r}")
    assert in_style(ask(release, release.router_url(), BASE_MODEL)[1], "base")


def test_dynamo_manifest_unchanged_and_each_adapter_routes_to_a_holder(release: Release) -> None:
    """Dynamo's manifest (replicas unset: the chart's default, 2) lands on both pods, one per group: placement
    ranks the pods of a base model together, whatever their engine. A second adapter with one replica lands
    on one of them; through the router each adapter is answered by a pod holding it."""
    release.apply(DYNAMO_EXAMPLE)
    release.apply(SQL)
    dm = release.wait_ready("my-lora", total=2)
    sql = release.wait_ready("sql-lora", total=1)
    assert {engine_of(p) for p in holders(release, "my-lora")} == {"lorafleet", "vllm"}, dm["status"]
    (sql_pod,) = holders(release, "sql-lora")
    print(f"[fleet] sql-lora placed on the {engine_of(sql_pod)} pod; status {json.dumps(sql['status']['endpoints'])}")
    for pod in release.pods("worker"):  # what each pod's management API (the sidecar on vLLM's) says it holds
        held = {"my-custom-lora", "sql-adapter"} if pod == sql_pod else {"my-custom-lora"}
        assert release.worker_loras(pod) == held, (engine_of(pod), release.worker_loras(pod))
    names = {"my-custom-lora", "sql-adapter", BASE_MODEL}
    wait_for(lambda: names <= release.models(), 60, "the router to list the base model and both adapters")

    french = check_holders_answer(release, "my-lora", "my-custom-lora", "french")
    check_holders_answer(release, "sql-lora", "sql-adapter", "sql")
    print(f"[fleet] my-custom-lora (french) per engine: {french}")
    router = release.router_url()
    for _ in range(4):
        engine, answer = ask(release, router, "sql-adapter")
        assert engine == engine_of(sql_pod) and in_style(answer, "sql"), (engine, answer)
    # Two requests at once go to the two holders (the router sends each to the holder with fewer in flight).
    seen: set[str] = set()
    questions = [f"What is the capital of {c}?" for c in ("France", "Italy", "Spain", "Germany", "Japan", "Peru")]
    with ThreadPoolExecutor(2) as pool:
        for pair in zip(questions[::2], questions[1::2], strict=True):
            for engine, answer in pool.map(lambda q: ask(release, router, "my-custom-lora", q), pair):
                assert in_style(answer, "french"), (engine, answer)
                seen.add(engine)
    assert seen == {"lorafleet", "vllm"}, seen


def test_hot_swap_keeps_serving(release: Release) -> None:
    """The DynamoModel's source changes under traffic: both holders swap to the new weights (vLLM in place under
    the same name), no non-streamed request through the router fails."""
    release.wait_ready("my-lora", total=2)
    url, auth = f"{release.router_url()}/v1/completions", release.inference_headers()
    started = time.monotonic()
    with (
        Load(url, "my-custom-lora", clients=2, pause=0.2, tokens=4, headers=auth) as traffic,
        Load(url, BASE_MODEL, clients=1, pause=0.2, tokens=4, headers=auth) as base,
    ):
        patch = {"spec": {"source": {"uri": "s3://my-bucket/my-lora-v2"}}}
        release.kubectl("patch", "dm", "my-lora", "--type=merge", "-p", json.dumps(patch))
        release.wait_ready("my-lora", total=2)
        swapped = traffic.ok
        wait_for(lambda: traffic.ok >= swapped + 4, 60, "requests answered after the swap")
    print(f"[fleet] hot swap in {time.monotonic() - started:.0f}s: {traffic.ok} adapter + {base.ok} base requests")
    assert traffic.ok > 0 and not traffic.failures, (traffic.ok, traffic.failures[:5])
    assert base.ok > 0 and not base.failures, (base.ok, base.failures[:5])
    pirate = check_holders_answer(release, "my-lora", "my-custom-lora", "pirate")
    assert set(pirate) == {"lorafleet", "vllm"}
    print(f"[fleet] my-custom-lora after the swap (pirate) per engine: {pirate}")
    assert in_style(ask(release, release.router_url(), "my-custom-lora")[1], "pirate")


def test_vllm_pod_restart_keeps_serving(release: Release) -> None:
    """The vLLM pod is deleted under traffic: the lorafleet pod serves meanwhile; the Deployment's new vLLM pod
    starts, the operator places the adapter on it again, and it serves it; no non-streamed request fails."""
    release.wait_ready("my-lora", total=2)
    (old,) = vllm_pods(release)
    url, auth = f"{release.router_url()}/v1/completions", release.inference_headers()
    started = time.monotonic()
    with (
        Load(url, "my-custom-lora", clients=2, pause=0.2, tokens=4, headers=auth) as traffic,
        Load(url, BASE_MODEL, clients=1, pause=0.2, tokens=4, headers=auth) as base,
    ):
        release.kubectl("delete", "pod", old["metadata"]["name"], "--wait=false")

        def replacement() -> dict[str, Any] | None:
            pods = [p for p in vllm_pods(release) if p["metadata"]["name"] != old["metadata"]["name"]]
            return pods[0] if pods and ready(pods[0]) else None

        new = wait_for(replacement, vllm_server.START_TIMEOUT_S, "a new vLLM pod Ready", interval=2)
        print(f"[fleet] the new vLLM pod Ready {time.monotonic() - started:.0f}s after the deletion")
        wait_for(
            lambda: new["metadata"]["name"] in {p["metadata"]["name"] for p in holders(release, "my-lora")},
            240,
            "my-lora placed on the new vLLM pod",
        )
        release.wait_ready("my-lora", total=2)
    print(f"[fleet] vLLM pod restart in {time.monotonic() - started:.0f}s: {traffic.ok} adapter + {base.ok} base")
    assert traffic.ok > 0 and not traffic.failures, (traffic.ok, traffic.failures[:5])
    assert base.ok > 0 and not base.failures, (base.ok, base.failures[:5])
    assert check_holders_answer(release, "my-lora", "my-custom-lora", "pirate").keys() == {"lorafleet", "vllm"}
    release.wait_ready("sql-lora", total=1)
    (sql_pod,) = holders(release, "sql-lora")
    engine, answer = ask(release, release.router_url(), "sql-adapter")
    assert engine == engine_of(sql_pod) and in_style(answer, "sql"), (engine, answer)
