"""`lorafleet-worker` CLI: `serve`'s flags, environment and defaults come from `WorkerSettings` and match the chart;
`serve` fails clearly on bad input."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from lorafleet_worker.cli import build_parser, main
from lorafleet_worker.settings import DEFAULTS, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


def test_serve_rejects_a_directory_without_a_model(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "lorafleet_worker", "serve", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "not a Hugging Face model directory" in r.stderr


def _settings(argv: list[str]) -> WorkerSettings:
    return WorkerSettings.from_args(build_parser().parse_args(["serve", *argv]))


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory `serve` accepts as a model (config.json), and an environment without the worker's variables."""
    for f in dataclasses.fields(WorkerSettings):
        if f.metadata["env"]:
            monkeypatch.delenv(f.metadata["env"], raising=False)
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_admin_token_sources(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--admin-token-file, else $LORAFLEET_ADMIN_TOKEN_FILE, else $LORAFLEET_ADMIN_TOKEN, else none."""
    model = ["--model", str(model_dir)]
    assert _settings(model).admin_token is None
    monkeypatch.setenv("LORAFLEET_ADMIN_TOKEN", " from-env ")
    assert _settings(model).admin_token == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert _settings([*model, "--admin-token-file", str(token_file)]).admin_token == "from-file"
    monkeypatch.setenv("LORAFLEET_ADMIN_TOKEN_FILE", str(token_file))
    assert _settings(model).admin_token == "from-file"
    token_file.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        _settings(model)


def test_serve_defaults_and_environment(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every default of `serve` as it has always been; the environment variables set theirs; flags win."""
    s = _settings(["--model", str(model_dir)])
    assert (s.served_model_name, s.host, s.port, s.system_port) == (str(model_dir), "0.0.0.0", 8000, 9090)
    assert (s.device, s.dtype, s.quantization, s.memory_budget, s.lora_backend) == ("cpu", "auto", None, None, "auto")
    assert (s.max_loras, s.max_cpu_loras, s.max_lora_rank, s.max_loaded_loras) == (8, 64, 64, None)
    assert (s.max_num_seqs, s.max_model_len, s.enable_prefix_caching, s.kv_events) == (64, None, True, None)
    assert (s.lora_cache_dir, s.chat_template, s.enable_auto_tool_choice, s.tool_call_parser) == (
        None,
        None,
        False,
        None,
    )
    assert (s.stall_timeout_s, s.admin_token, s.lora_enabled) == (60.0, None, True)
    monkeypatch.setenv("DYN_SYSTEM_PORT", "9191")
    monkeypatch.setenv("LORAFLEET_MAX_LOADED_LORAS", "5")
    monkeypatch.setenv("DYN_LORA_PATH", str(tmp_path / "loras"))
    monkeypatch.setenv("DYN_LORA_ENABLED", "false")
    s = _settings(["--model", str(model_dir)])
    assert (s.system_port, s.max_loaded_loras, s.lora_cache_dir, s.lora_enabled) == (9191, 5, tmp_path / "loras", False)
    s = _settings(["--model", str(model_dir), "--system-port", "9292", "--max-loaded-loras", "7"])
    assert (s.system_port, s.max_loaded_loras) == (9292, 7)


def test_help_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    """Each field of WorkerSettings is a `serve` flag or an environment variable, and `--help` shows it."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(WorkerSettings):
        names = [*f.metadata["flags"], *([f.metadata["env"]] if f.metadata["env"] else [])]
        assert names, f"{f.name}: neither a flag nor an environment variable"
        for name in names:
            assert name in text, f"{f.name}: {name} is not in serve --help"


def test_engine_defaults_are_the_settings_defaults() -> None:
    """The settings hand the engine each of its settings, under its keyword, with the engine's own default."""
    from lorafleet_worker.core.engine_core import EngineCore

    params = inspect.signature(EngineCore.__init__).parameters
    for keyword, value in DEFAULTS.engine_kwargs().items():
        assert keyword in params, f"the engine takes no {keyword!r}"
        assert params[keyword].default == value, f"{keyword}: engine default {params[keyword].default!r} != {value!r}"


def _chart_flags() -> set[str]:
    """The `serve` flags the chart passes (the worker container's args) or names in its worker values, and those
    of every `extraArgs` in the chart's values and the examples."""
    template = (ROOT / "charts/lorafleet/templates/worker/deployment.yaml").read_text()
    args = template[template.index("- serve") : template.index("env:", template.index("- serve"))]
    values = (ROOT / "charts/lorafleet/values.yaml").read_text()
    worker_values = values[values.index("\nworkerDefaults:") : values.index("\nworkers:")]
    flags = set(re.findall(r"(--[a-z][a-z0-9-]*)", args + worker_values))

    def extra_args(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "extraArgs" and isinstance(value, list):
                    flags.update(str(a).split("=")[0] for a in value if str(a).startswith("--"))
                extra_args(value)
        elif isinstance(node, list):
            for item in node:
                extra_args(item)

    for path in [ROOT / "charts/lorafleet/values.yaml", *sorted((ROOT / "examples").glob("*.yaml"))]:
        for doc in yaml.safe_load_all(path.read_text()):
            extra_args(doc)
    return flags


def test_every_flag_the_chart_passes_exists() -> None:
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    known = {option for action in serve._actions for option in action.option_strings}
    flags = _chart_flags()
    assert {"--model", "--max-loras", "--health-stall-timeout"} <= flags  # the template was read
    assert flags <= known, f"flags the chart uses that `serve` does not have: {sorted(flags - known)}"
