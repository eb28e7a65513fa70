"""The real model in the cluster demo: a SmolLM2 worker group, the trained adapters as DynamoModels.

`make demo` (demo.run_demo) calls these around its own steps:

- `prepare()` before the cluster starts: the converted model and the trained adapters (cached;
  the first run on a machine trains them, a few minutes);
- `worker_group(model)`: chart values for one CPU worker serving the model from a read-only
  hostPath volume (the cache directory), `tool_choice: "auto"` on (Hermes parser), next to the
  demo's tiny Qwen3 group;
- `deploy_adapters(release, adapters)`: uploads each adapter to the chart's MinIO and applies one
  DynamoModel per adapter (`s3://` source);
- `show(release)`: waits for them to be Ready and asks the base model and every adapter the same
  questions through the router, printed side by side; then the `json_schema` question (base
  model and JSON adapter) and the `auto` tool question (base model and tools adapter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from demo.real_model import SERVED_NAME, prepare_model
from demo.side_by_side import (
    ADAPTER_MODELS,
    AUTO_TOOL_ARGS,
    ask_json_schema,
    ask_side_by_side,
    ask_tool_call,
    describe,
    models_to_ask,
)
from demo.train_adapters import trained_adapters

BUCKET_PREFIX = "s3://lorafleet/smollm2"


def prepare() -> tuple[Path, dict[str, Path]]:
    """The model directory and style -> adapter directory (trained here the first time)."""
    return prepare_model(), trained_adapters()


def worker_group(model: Path, replicas: int = 1) -> dict[str, Any]:
    """A `workers` entry of the chart serving `model` (a directory on this machine, mounted read-only)."""
    return {
        "name": "smollm2",
        "baseModelName": SERVED_NAME,
        "replicas": replicas,
        "device": "cpu",
        "dtype": "float32",
        "maxLoras": len(ADAPTER_MODELS),
        "maxModelLen": 1024,
        "extraArgs": AUTO_TOOL_ARGS,
        "model": {
            "volume": {"hostPath": {"path": str(model.parent), "type": "Directory"}},
            "path": model.name,
        },
    }


def dynamo_models(adapters: dict[str, Path]) -> str:
    """One DynamoModel per trained adapter, its source in the chart's MinIO."""
    docs = [
        {
            "apiVersion": "nvidia.com/v1alpha1",
            "kind": "DynamoModel",
            "metadata": {"name": f"smollm2-{style}"},
            "spec": {
                "modelName": ADAPTER_MODELS[style],
                "baseModelName": SERVED_NAME,
                "modelType": "lora",
                "source": {"uri": f"{BUCKET_PREFIX}/{style}"},
            },
        }
        for style in adapters
    ]
    return yaml.safe_dump_all(docs, sort_keys=False)


def deploy_adapters(release: Any, adapters: dict[str, Path], say: Any = print) -> None:
    for style, path in adapters.items():
        say(f"uploading the trained adapter {style} ({describe(path)}) to {BUCKET_PREFIX}/{style}")
        release.upload(path, f"{BUCKET_PREFIX}/{style}")
    say("kubectl apply: one DynamoModel per trained adapter (base model " + SERVED_NAME + ")")
    release.apply(dynamo_models(adapters))


def show(release: Any, adapters: dict[str, Path], say: Any = print) -> None:
    for style in adapters:
        release.wait_ready(f"smollm2-{style}", timeout=300)
    router, key = release.router_url(), release.api_key()
    say(f"the same questions to {SERVED_NAME} and to each trained adapter, through the router ({router})")
    ask_side_by_side(router, models_to_ask(), api_key=key)
    say("the same json_schema answer asked of the base model and of the JSON adapter (structured output)")
    ask_json_schema(router, {"base": SERVED_NAME, "json": ADAPTER_MODELS["json"]}, api_key=key)
    say('a weather question with tools and tool_choice "auto" to the base model and the tools adapter')
    ask_tool_call(router, {"base": SERVED_NAME, "tools": ADAPTER_MODELS["tools"]}, api_key=key)
