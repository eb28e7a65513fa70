"""The operator's settings (``lorafleet-operator --help``): one frozen dataclass, read from the
environment (``LORAFLEET_*``) and flags; each field declares its variable and help once (see
``envflags``). The router's are ``lorafleet_router.settings.RouterSettings``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lorafleet_operator.envflags import WatchScope
from lorafleet_operator.envflags import setting as _opt


@dataclass(frozen=True, repr=False)  # EnvSettings.__repr__ hides secrets
class OperatorSettings(WatchScope):
    """Everything the operator can be told; see ``lorafleet-operator --help``."""

    default_replicas: int = _opt(2, "LORAFLEET_DEFAULT_REPLICAS", "worker pods per adapter when spec.replicas is unset")
    management_port: int = _opt(9090, "LORAFLEET_MANAGEMENT_PORT", "workers' management (system) port")
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
    bind_host: str = _opt("0.0.0.0", "LORAFLEET_BIND_HOST", "address of the liveness and metrics listeners")
    peering: str = _opt("", "LORAFLEET_PEERING", "kopf peering name for several replicas (empty = standalone)")
    leader_elect: bool = _opt(
        False, "LORAFLEET_LEADER_ELECT", "several replicas: only the holder of the Lease lorafleet-operator acts"
    )

    @property
    def store_configured(self) -> bool:
        return bool(self.store_bucket)

    def token(self) -> str | None:
        """The admin token (the file wins over the plain value), or None."""
        if self.admin_token_file:
            return Path(self.admin_token_file).read_text().strip() or None
        return self.admin_token or None

    def validate(self) -> None:
        if self.default_replicas < 1:
            raise ValueError("default replicas must be >= 1")
        if self.autoscale_interval <= 0 or self.autoscale_cooldown < 0:
            raise ValueError("the autoscale interval must be > 0, the cool-down >= 0")
        if self.balance not in ("autoscaled", "all", "off") or self.balance_epsilon < 0:
            raise ValueError("--balance must be autoscaled, all or off, and --balance-epsilon >= 0")
