"""`make demo`: the whole lorafleet system on one machine, installed by its Helm chart.

Starts the local control plane and node agent (tests/infra), generates a tiny base model and
three LoRA adapters, installs the chart (operator, router, MinIO, two CPU workers that generate
the same tiny model), uploads adapters to the chart's MinIO, serves one through a local
Hugging Face endpoint (synced by the operator's Job), applies the example DynamoModels (one of
them NVIDIA Dynamo's manifest, verbatim), waits for Ready, and asks every adapter through the
router. The tiny models have random weights, so their text is noise: for them the demo shows what a
person can check (Ready, where each adapter is placed, that an answer streamed through the router, and
its speed). Beside them, a worker group serves the real model (SmolLM2-135M-Instruct, `demo.real_model`)
with five adapters trained on this machine (`demo.train_adapters`), and the demo prints the answers
of the base model and of each adapter to the same questions side by side (`demo.real_fleet`).
`DEMO_KEEP=1` keeps everything running and prints how to reach it.

If the operator or the control-plane tools are not available yet, it falls back to
`make demo-worker` (a single worker, no Kubernetes) and says so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# DynamoModel -> (OpenAI model name, where its adapter comes from)
MODELS = {
    "my-lora": ("my-custom-lora", "s3://my-bucket/my-lora"),  # examples/dynamo-my-lora.yaml (Dynamo's)
    "code-lora": ("code-adapter", "s3://lorafleet/loras/code-lora"),  # examples/s3-loras.yaml
    "sql-lora": ("sql-adapter", "s3://lorafleet/loras/sql-lora"),
    "support-lora": ("support-adapter", "hf://lorafleet-demo/support-lora@main"),  # examples/hf-lora.yaml
}
PROBE_TOKENS = 32  # streamed through the router per tiny model (ignore_eos: always this many)
_T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


def missing_parts() -> list[str]:
    """What the full demo needs that is not there yet."""
    missing = []
    try:
        from lorafleet_devcluster.cluster import tool_path

        for tool in ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl", "helm"):
            try:
                tool_path(tool)
            except FileNotFoundError:
                missing.append(f"{tool} (make setup builds it)")
        from lorafleet_devcluster.minio import minio_binary

        if not minio_binary().is_file():
            missing.append("minio (make setup builds it)")
    except ImportError as exc:
        missing.append(f"the local control plane ({exc})")
    for module in ("lorafleet_operator.controller", "lorafleet_router.router", "lorafleet_devcluster.nodeagent"):
        try:
            __import__(module)
        except ImportError as exc:
            missing.append(f"{module} ({exc})")
    return missing


def fallback(missing: list[str]) -> int:
    say("the full demo needs: " + "; ".join(missing))
    say("falling back to `make demo-worker` and `make demo-real` (one worker each, no Kubernetes)")
    status = subprocess.call(["make", "--no-print-directory", "demo-worker"], cwd=ROOT)
    return status or subprocess.call(["make", "--no-print-directory", "demo-real"], cwd=ROOT)


@contextlib.contextmanager
def adapters_and_hub(workdir: Path) -> Iterator[tuple[dict[str, Path], str]]:
    """Tiny base model + one adapter per DynamoModel; the hf:// one is served by a local Hub."""
    from lorafleet_devcluster.hfhub import LocalHub
    from lorafleet_worker_dev.tiny import make_tiny_adapter, make_tiny_model

    say("generating a tiny qwen3 base model and 4 LoRA adapters (real PEFT files)")
    base = make_tiny_model(workdir / "base", "qwen3")
    dirs = {
        name: make_tiny_adapter(workdir / name, base, rank=4 + 2 * i, seed=10 + i, strength=3.0)
        for i, name in enumerate(MODELS)
    }
    with LocalHub(workdir / "hub") as hub:
        sha = hub.commit("lorafleet-demo/support-lora", dirs["support-lora"])
        say(f"local Hugging Face endpoint {hub.url}: lorafleet-demo/support-lora@main = {sha[:12]}")
        yield dirs, hub.url


@dataclass
class StreamProbe:
    """One completion streamed through the router with the `openai` client."""

    tokens: int  # completion tokens, as the final usage chunk reports them
    chunks: int  # streamed chunks that carried text
    ttft_s: float
    decode_tok_s: float  # tokens after the first, per second
    finish_reason: str | None


def stream_probe(router: str, model: str, api_key: str, max_tokens: int = PROBE_TOKENS) -> StreamProbe:
    """Stream `max_tokens` tokens of `model` through the router (with its API key) and time them."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{router}/v1", api_key=api_key, max_retries=0, timeout=120)
    t0 = time.monotonic()
    first = last = t0
    chunks, tokens, finish = 0, 0, None
    stream = client.completions.create(
        model=model, prompt="The fleet", max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.text:
                last = time.monotonic()
                first = first if chunks else last
                chunks += 1
            finish = choice.finish_reason or finish
    decode_s = last - first
    return StreamProbe(tokens, chunks, first - t0, (tokens - 1) / decode_s if decode_s > 0 else 0.0, finish)


def show_tiny_models(router: str, api_key: str, holders: dict[str, str]) -> None:
    """Per tiny model: the pods that hold it and one answer streamed through the router, timed."""
    print(
        "\n  The tiny models have random weights, so their text is noise and is not shown. What can be\n"
        f"  checked: where each one is served, and that {PROBE_TOKENS} tokens stream back through the router.\n"
        f"\n  {'model':<18} {'streamed':<22} {'TTFT':>7} {'tok/s':>7}  served by",
        flush=True,
    )
    for model, pods in holders.items():
        probe = stream_probe(router, model, api_key)
        streamed = f"{probe.tokens} tokens, {probe.chunks} chunks"
        ok = probe.tokens == PROBE_TOKENS and probe.finish_reason == "length"
        print(
            f"  {model:<18} {streamed:<22} {probe.ttft_s * 1000:5.0f} ms {probe.decode_tok_s:7.1f}  {pods}"
            + ("" if ok else f"  UNEXPECTED (finish_reason {probe.finish_reason})"),
            flush=True,
        )


def wait_for_interrupt(namespace: str, router: str, api_key: str, kubeconfig: Path) -> None:
    from lorafleet_devcluster.cluster import tool_path

    print(
        "\nDEMO_KEEP=1: everything stays up until Ctrl-C. From another shell:\n"
        f"  export KUBECONFIG={kubeconfig}\n"
        f"  alias kubectl={tool_path('kubectl')}\n"
        f"  kubectl -n {namespace} get dm,pods\n"
        f"  export OPENAI_API_KEY={api_key}   # the router's API key (the chart's auth.apiKey)\n"
        f'  curl {router}/v1/models -H "Authorization: Bearer $OPENAI_API_KEY"\n'
        f'  curl {router}/v1/completions -H "Authorization: Bearer $OPENAI_API_KEY" '
        "-H 'content-type: application/json' "
        '-d \'{"model": "my-custom-lora", "prompt": "The fleet", "max_tokens": 16}\'\n',
        flush=True,
    )
    stop = False

    def handler(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    while not stop:
        signal.pause()


def run() -> int:
    from lorafleet_devcluster.session import shared_cluster
    from lorafleet_devcluster.stack import BASE_MODEL, Release, default_values, wait_for

    from demo import real_fleet

    keep = os.environ.get("DEMO_KEEP", "") not in ("", "0")
    workdir = Path(tempfile.mkdtemp(prefix="lorafleet-demo-"))
    try:
        say("the real model (SmolLM2-135M-Instruct) and its trained adapters (the first run trains them)")
        real_model, real_adapters = real_fleet.prepare()
        with adapters_and_hub(workdir) as (dirs, hub_url):
            say("starting the local control plane (etcd, kube-apiserver, kube-controller-manager) and node agent")
            with shared_cluster() as cluster:
                release = Release(cluster, cluster.new_namespace("demo"), log=say)
                values = default_values(cluster, workers=2, hf_endpoint=hub_url)
                values["auth"] = {"apiKey": {"generate": True}}  # the router and workers require a key
                values["workers"].append(real_fleet.worker_group(real_model))
                release.deploy(values)
                for name, (_, uri) in MODELS.items():
                    if uri.startswith("s3://"):
                        say(f"uploading adapter {name} to {uri} (the chart's MinIO)")
                        release.upload(dirs[name], uri)
                for example in ("dynamo-my-lora.yaml", "s3-loras.yaml", "hf-lora.yaml"):
                    say(f"kubectl apply -f examples/{example}")
                    release.apply(EXAMPLES / example)
                real_fleet.deploy_adapters(release, real_adapters, say)
                base_pods = sorted(
                    p["metadata"]["name"]
                    for p in release.pods("worker")
                    if p["metadata"]["labels"].get("lorafleet.dev/worker-group") == "qwen"
                )
                holders = {BASE_MODEL: ", ".join(base_pods) + " (base)"}
                for name, (model_name, _) in MODELS.items():
                    dm = release.wait_ready(name, timeout=300)
                    pods = ", ".join(e["podName"] for e in dm["status"]["endpoints"])
                    holders[model_name] = pods
                    say(f"DynamoModel {name} Ready on {pods}")
                print("\n$ kubectl get dm\n" + release.table(), flush=True)
                names = {BASE_MODEL, *(m for m, _ in MODELS.values())}
                wait_for(lambda: names <= release.models(), 60, "the router to list every model")
                router, api_key = release.router_url(), release.api_key()
                assert api_key, "the operator generates the inference API key"
                say(f"streaming from every tiny model through the router Service ({router}), with its API key")
                show_tiny_models(router, api_key, holders)
                real_fleet.show(release, real_adapters, say)
                if keep:
                    wait_for_interrupt(release.namespace, router, api_key, cluster.kubeconfig)
                say("tearing down")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    say("done")
    return 0


def main() -> int:
    missing = missing_parts()
    if missing:
        return fallback(missing)
    return run()


if __name__ == "__main__":
    sys.exit(main())
