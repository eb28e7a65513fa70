"""Operator and router settings: one dataclass, read from env (``LORAFLEET_*``) and CLI flags.

Every field declares its environment variable and help text once; ``add_arguments`` turns
the fields into argparse flags (``--default-replicas``) and ``Settings.from_sources``
applies defaults < environment < flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _opt(default: Any, env: str, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"env": env, "help": help, **kw})


@dataclass(frozen=True)
class Settings:
    """Everything the operator and router can be told; see ``lorafleet-operator --help``."""

    namespaces: tuple[str, ...] = field(
        default=(), metadata={"env": "LORAFLEET_NAMESPACES", "help": "namespaces to watch (comma list / repeat)"}
    )
    all_namespaces: bool = _opt(False, "LORAFLEET_ALL_NAMESPACES", "watch every namespace (cluster-wide)")
    default_replicas: int = _opt(2, "LORAFLEET_DEFAULT_REPLICAS", "worker pods per adapter when spec.replicas is unset")
    management_port: int = _opt(9090, "LORAFLEET_MANAGEMENT_PORT", "workers' management (system) port")
    inference_port: int = _opt(8000, "LORAFLEET_INFERENCE_PORT", "workers' OpenAI inference port (router)")
    admin_token: str = _opt("", "LORAFLEET_ADMIN_TOKEN", "admin token for the workers' management API", secret=True)
    admin_token_file: str = _opt("", "LORAFLEET_ADMIN_TOKEN_FILE", "file holding the admin token (mounted Secret)")
    # object store (MinIO/S3) for hf:// sources
    store_endpoint: str = _opt("", "LORAFLEET_STORE_ENDPOINT", "object store URL, e.g. http://minio:9000")
    store_bucket: str = _opt("", "LORAFLEET_STORE_BUCKET", "bucket for synced adapters (empty = no object store)")
    store_prefix: str = _opt("", "LORAFLEET_STORE_PREFIX", "key prefix inside the bucket")
    store_secret: str = _opt(
        "", "LORAFLEET_STORE_SECRET", "Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for the store"
    )
    store_region: str = _opt("us-east-1", "LORAFLEET_STORE_REGION", "object store region")
    # sync Job
    sync_image: str = _opt("lorafleet/operator:dev", "LORAFLEET_SYNC_IMAGE", "image of the sync Job (lorafleet-sync)")
    sync_service_account: str = _opt("", "LORAFLEET_SYNC_SERVICE_ACCOUNT", "ServiceAccount of sync Job pods")
    sync_backoff_limit: int = _opt(4, "LORAFLEET_SYNC_BACKOFF_LIMIT", "retries of a sync Job on retryable failures")
    sync_resources: str = _opt("", "LORAFLEET_SYNC_RESOURCES", "resources of the sync Job container (JSON)")
    image_pull_secrets: tuple[str, ...] = field(
        default=(),
        metadata={"env": "LORAFLEET_IMAGE_PULL_SECRETS", "help": "imagePullSecrets of sync Job pods (comma list)"},
    )
    sync_deadline: int = _opt(3600, "LORAFLEET_SYNC_DEADLINE", "activeDeadlineSeconds of a sync Job")
    sync_ttl: int = _opt(3600, "LORAFLEET_SYNC_TTL", "ttlSecondsAfterFinished of a sync Job")
    revision_interval: float = _opt(
        300.0, "LORAFLEET_REVISION_INTERVAL", "seconds between re-resolutions of hf:// branches and tags"
    )
    hf_endpoint: str = _opt("", "LORAFLEET_HF_ENDPOINT", "HF_ENDPOINT passed to sync Jobs")
    hf_token_secret: str = _opt("", "LORAFLEET_HF_TOKEN_SECRET", "Secret with HF_TOKEN passed to sync Jobs")
    # behaviour
    load_timeout: float = _opt(120.0, "LORAFLEET_LOAD_TIMEOUT", "seconds per load call to a worker")
    call_timeout: float = _opt(10.0, "LORAFLEET_CALL_TIMEOUT", "seconds per list/unload call to a worker")
    delete_timeout: float = _opt(30.0, "LORAFLEET_DELETE_TIMEOUT", "bounded wait for unloads on deletion")
    max_concurrent_calls: int = _opt(16, "LORAFLEET_MAX_CONCURRENT_CALLS", "worker calls in flight at once")
    reconcile_workers: int = _opt(8, "LORAFLEET_RECONCILE_WORKERS", "DynamoModels reconciled at once")
    drift_interval: float = _opt(30.0, "LORAFLEET_DRIFT_INTERVAL", "seconds between drift checks of every pod")
    unload_grace: float = _opt(
        5.0, "LORAFLEET_UNLOAD_GRACE", "seconds the new placement is published before leavers are unloaded"
    )
    demand_urls: tuple[str, ...] = field(
        default=(),
        metadata={
            "env": "LORAFLEET_DEMAND_URLS",
            "help": "routers' demand endpoints (http://ROUTER:8000/demand, comma list) for spec.autoscaling",
        },
    )
    autoscale_interval: float = _opt(
        15.0, "LORAFLEET_AUTOSCALE_INTERVAL", "seconds between demand polls of the routers (spec.autoscaling)"
    )
    autoscale_cooldown: float = _opt(
        300.0, "LORAFLEET_AUTOSCALE_COOLDOWN", "seconds after a replica change before an autoscaled adapter shrinks"
    )
    balance: str = _opt(
        "autoscaled",
        "LORAFLEET_BALANCE",
        "which adapters are placed by demand-weighted bounded loads: autoscaled (spec.autoscaling only; "
        "fixed-replica ones take their top HRW pods with room), all, or off (plain HRW within capacity)",
    )
    balance_epsilon: float = _opt(
        0.25,
        "LORAFLEET_BALANCE_EPSILON",
        "balance bound: a pod above (1 + epsilon) x the mean demand-weighted load sheds its largest "
        "movable adapters; new replicas land only below 0.9x that bound",
    )
    retry_base: float = _opt(1.0, "LORAFLEET_RETRY_BASE", "first retry delay (doubles up to --retry-max)")
    retry_max: float = _opt(60.0, "LORAFLEET_RETRY_MAX", "longest retry delay")
    # process
    liveness_port: int = _opt(8080, "LORAFLEET_LIVENESS_PORT", "port of /healthz (0 = off)")
    metrics_port: int = _opt(9100, "LORAFLEET_METRICS_PORT", "port of Prometheus /metrics (0 = off)")
    bind_host: str = _opt("0.0.0.0", "LORAFLEET_BIND_HOST", "address for liveness/metrics/router listeners")
    peering: str = _opt("", "LORAFLEET_PEERING", "kopf peering name for several replicas (empty = standalone)")
    leader_elect: bool = _opt(
        False, "LORAFLEET_LEADER_ELECT", "several replicas: only the holder of the Lease lorafleet-operator acts"
    )
    router_port: int = _opt(8000, "LORAFLEET_ROUTER_PORT", "router listen port")
    router_timeout: float = _opt(600.0, "LORAFLEET_ROUTER_TIMEOUT", "router: seconds per proxied request")
    router_unavailable_wait: float = _opt(
        30.0, "LORAFLEET_ROUTER_UNAVAILABLE_WAIT", "router: seconds a request waits for a holder when none is ready"
    )
    router_policy: str = _opt(
        "cache-aware",
        "LORAFLEET_ROUTER_POLICY",
        "router: cache-aware (prefix affinity within a load bound) or fewest-in-flight",
    )
    router_balance: float = _opt(
        1.25, "LORAFLEET_ROUTER_BALANCE", "router (cache-aware): most in-flight requests of a pod, times the mean"
    )
    router_min_match: float = _opt(
        0.5, "LORAFLEET_ROUTER_MIN_MATCH", "router (cache-aware): least fraction of a prompt seen on a pod to prefer it"
    )
    router_drain_delay: float = _opt(
        5.0,
        "LORAFLEET_ROUTER_DRAIN_DELAY",
        "router: seconds it keeps serving after SIGTERM with /ready failing, so Services stop sending to it",
    )
    router_drain_timeout: float = _opt(
        20.0, "LORAFLEET_ROUTER_DRAIN_TIMEOUT", "router: then, seconds requests in flight get to finish before it exits"
    )
    demand_window: float = _opt(
        30.0, "LORAFLEET_DEMAND_WINDOW", "router: seconds over which per-adapter demand (GET /demand) is averaged"
    )

    @property
    def store_configured(self) -> bool:
        return bool(self.store_bucket)

    def token(self) -> str | None:
        """The admin token (the file wins over the plain value), or None."""
        if self.admin_token_file:
            return Path(self.admin_token_file).read_text().strip() or None
        return self.admin_token or None

    def __repr__(self) -> str:  # never print secrets
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("secret")}
        return f"Settings({shown})"

    @classmethod
    def from_sources(cls, env: Mapping[str, str] | None = None, args: argparse.Namespace | None = None) -> Settings:
        """Defaults, overridden by ``env``, overridden by flags given in ``args``."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw: Any = getattr(args, f.name, None) if args is not None else None
            if raw is None and f.metadata["env"] in env:
                raw = env[f.metadata["env"]]
            if raw is not None:
                values[f.name] = _convert(f, raw)
        settings = cls(**values)
        if settings.default_replicas < 1:
            raise ValueError("default replicas must be >= 1")
        if settings.demand_window <= 0 or settings.autoscale_interval <= 0 or settings.autoscale_cooldown < 0:
            raise ValueError("demand window and autoscale interval must be > 0, the cool-down >= 0")
        if settings.balance not in ("autoscaled", "all", "off") or settings.balance_epsilon < 0:
            raise ValueError("--balance must be autoscaled, all or off, and --balance-epsilon >= 0")
        return settings


def _convert(f: dataclasses.Field[Any], raw: Any) -> Any:
    kind = type(f.default) if f.default is not dataclasses.MISSING else tuple
    if kind is tuple:
        items = raw if isinstance(raw, list | tuple) else [raw]
        return tuple(n.strip() for item in items for n in str(item).split(",") if n.strip())
    if kind is bool:
        return raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes", "on")
    try:
        return kind(raw)
    except ValueError as e:
        raise ValueError(f"{f.metadata['env']} / --{f.name.replace('_', '-')}: {e}") from None


def add_arguments(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """Add one flag per settings field (or per field in ``names``); unset flags stay None."""
    for f in dataclasses.fields(Settings):
        if names is not None and f.name not in names:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata['help']} (env {f.metadata['env']}"
        help_text += ")" if f.metadata.get("secret") else f", default {f.default!r})"
        if isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        elif f.name == "namespaces":
            parser.add_argument("--namespace", "-n", dest="namespaces", action="append", default=None, help=help_text)
        else:
            parser.add_argument(flag, default=None, metavar=f.name.upper(), help=help_text)
