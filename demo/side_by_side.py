"""Ask the real model and each trained adapter the same questions; print the answers side by side.

`ask_side_by_side(url, ...)` works against anything that speaks the OpenAI chat API: the cluster
demo passes the router's URL (`demo.run_demo`), `python -m demo.side_by_side` (or `make demo-real`)
starts one worker with the real model and loads the adapters itself, without Kubernetes.
Greedy decoding, so the same question gives the same answer every run. `ask_json_schema` then
asks the base model and the JSON adapter for the same `json_schema` answer (structured output): the
grammar makes both valid; the adapter was trained to give it. `ask_tool_call` asks the base model and
the tools adapter a weather question with `tools` and `tool_choice: "auto"` (the worker started with
`--enable-auto-tool-choice --tool-call-parser hermes`): the base model, never trained for tools,
answers in words; the adapter calls `get_weather`. Each takes the `api_key` the router requires (the cluster
demo installs the chart with one), sent as `Authorization: Bearer <key>` as the `openai` client does.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from lorafleet_worker_dev.launch import run_in_workdir

from demo.adapter_data import ADAPTERS, DEMO_QUESTIONS, TOOL_QUESTION, TOOLS
from demo.real_model import SERVED_NAME, prepare_model
from demo.train_adapters import trained_adapters

MAX_TOKENS = 40
# The OpenAI model name each trained adapter is served under.
ADAPTER_MODELS = {style: f"smollm2-{style}" for style in ADAPTERS}
# What `ask_tool_call` needs of the worker (vLLM's flags).
AUTO_TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def chat(client: httpx.Client, url: str, model: str, question: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
            "temperature": 0}  # fmt: skip
    r = client.post(f"{url}/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{model}: HTTP {r.status_code} {r.text[:300]}")
    content: str = r.json()["choices"][0]["message"]["content"]
    return content


def bearer(api_key: str | None) -> dict[str, str]:
    """The headers an OpenAI client sends for `api_key` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def ask_side_by_side(
    url: str,
    models: Mapping[str, str],
    questions: Sequence[str] = DEMO_QUESTIONS,
    width: int = 100,
    api_key: str | None = None,
) -> dict[str, dict[str, str]]:
    """Ask every (label -> model name) every question through `url`; print a block per question."""
    answers: dict[str, dict[str, str]] = {}
    with httpx.Client(timeout=300, headers=bearer(api_key)) as client:
        for question in questions:
            print(f"\n  Q: {question}", flush=True)
            answers[question] = {}
            for label, model in models.items():
                answer = chat(client, url, model, question)
                answers[question][label] = answer
                print(f"    {label:<12} {one_line(answer, width - 16)}", flush=True)
    return answers


def one_line(text: str, width: int) -> str:
    """`text` on one line, shortened to `width` characters."""
    return textwrap.shorten(" ".join(text.split()), width=width, placeholder=" …")


# The json_schema question: the shape the JSON adapter was trained on (demo/adapter_data.py).
JSON_QUESTION = "What is the capital of Italy?"
CAPITAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"country": {"type": "string", "maxLength": 40}, "capital": {"type": "string", "maxLength": 40}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}


def ask_json_schema(
    url: str,
    models: Mapping[str, str],
    question: str = JSON_QUESTION,
    schema: Mapping[str, Any] = CAPITAL_SCHEMA,
    api_key: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Ask each (label -> model) `question` with `response_format: json_schema`; print and return the parsed
    answers (json.loads of each: the grammar guarantees they parse)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": dict(schema), "strict": True}}
    print(f"\n  Q (json_schema {json.dumps(schema['properties'])}): {question}", flush=True)
    answers: dict[str, dict[str, Any]] = {}
    with httpx.Client(timeout=300, headers=bearer(api_key)) as client:
        for label, model in models.items():
            body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 120,
                    "temperature": 0, "response_format": fmt}  # fmt: skip
            r = client.post(f"{url}/v1/chat/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{model}: HTTP {r.status_code} {r.text[:300]}")
            choice = r.json()["choices"][0]
            answers[label] = json.loads(choice["message"]["content"])
            print(f"    {label:<12} {choice['message']['content']}  ({choice['finish_reason']})", flush=True)
    return answers


def ask_tool_call(
    url: str, models: Mapping[str, str], question: str = TOOL_QUESTION, width: int = 100, api_key: str | None = None
) -> dict[str, dict[str, Any]]:
    """Ask each (label -> model) `question` with the demo's tools and `tool_choice: "auto"`; print each answer
    (its text, or the calls made) and return the messages."""
    print(f"\n  Q (tools {', '.join(t['function']['name'] for t in TOOLS)}, tool_choice auto): {question}", flush=True)
    answers: dict[str, dict[str, Any]] = {}
    with httpx.Client(timeout=300, headers=bearer(api_key)) as client:
        for label, model in models.items():
            body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
                    "temperature": 0, "tools": TOOLS, "tool_choice": "auto"}  # fmt: skip
            r = client.post(f"{url}/v1/chat/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{model}: HTTP {r.status_code} {r.text[:300]}")
            choice = r.json()["choices"][0]
            message = answers[label] = choice["message"]
            calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in message.get("tool_calls") or []]
            text = one_line("; ".join(calls) or message["content"] or "", width - 16)
            print(f"    {label:<12} {text}  ({choice['finish_reason']})", flush=True)
    return answers


def models_to_ask() -> dict[str, str]:
    """label -> OpenAI model name: the base model, then every adapter."""
    return {"base": SERVED_NAME, **ADAPTER_MODELS}


def run_single_worker(workdir: Path) -> int:
    """One worker with the real model; the trained adapters loaded through its management API."""
    from lorafleet_worker_dev.launch import WorkerStartError, free_port, launch_worker, stop_worker, wait_ready

    model = prepare_model()
    adapters = trained_adapters()
    host = "127.0.0.1"
    port, system_port = free_port(host), free_port(host)
    url, system_url = f"http://{host}:{port}", f"http://{host}:{system_port}"
    log_path = workdir / "worker.log"
    print(f"==> starting lorafleet-worker serve on {model.name} ({url}; log {log_path})", flush=True)
    env = {"LORAFLEET_FILE_ROOTS": str(next(iter(adapters.values())).parent), "DYN_LORA_PATH": str(workdir / "cache"),
           "LORAFLEET_ADMIN_TOKEN": ""}  # fmt: skip
    with log_path.open("wb") as log:
        args = ["--max-loras", str(len(adapters)), "--max-model-len", "1024", *AUTO_TOOL_ARGS]
        proc = launch_worker(
            model, name=SERVED_NAME, host=host, port=port, system_port=system_port, args=args, env=env, log=log
        )
    try:
        wait_ready(proc, system_url)
        with httpx.Client(timeout=300) as client:
            for style, path in adapters.items():
                body: dict[str, Any] = {"lora_name": ADAPTER_MODELS[style], "source": {"uri": f"file://{path}"}}
                r = client.post(f"{system_url}/v1/loras", json=body)
                if r.status_code != 200:
                    print(f"loading {style} failed: {r.status_code} {r.text}", file=sys.stderr)
                    return 1
                print(f"==> loaded adapter {ADAPTER_MODELS[style]} ({describe(path)})", flush=True)
        ask_side_by_side(url, models_to_ask())
        ask_json_schema(url, {"base": SERVED_NAME, "json": ADAPTER_MODELS["json"]})
        ask_tool_call(url, {"base": SERVED_NAME, "tools": ADAPTER_MODELS["tools"]})
        return 0
    except WorkerStartError as e:
        print(f"error: {e}\n{log_path.read_text(errors='replace')[-4000:]}", file=sys.stderr)
        return 1
    finally:
        stop_worker(proc)


def describe(adapter: Path) -> str:
    """'rank 8 on q_proj, v_proj' from an adapter's adapter_config.json."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    return f"rank {config['r']} on {', '.join(sorted(config['target_modules']))}"


def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.splitlines()[0] if __doc__ else None
    return run_in_workdir(
        run_single_worker, argv, description=description, workdir_help="where the worker's log and cache go",
        prefix="lorafleet-demo-real-",
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
