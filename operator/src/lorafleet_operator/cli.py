"""``lorafleet-operator``: the DynamoModel operator's entry point (``build_parser`` lists its flags)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Sequence

from lorafleet_operator.api import API_VERSION
from lorafleet_operator.settings import OperatorSettings

DESCRIPTION = (
    f"Reconciles {API_VERSION} DynamoModels: places LoRA adapters on worker pods by HRW, "
    "syncs hf:// sources into the object store, loads/unloads them through the workers' "
    "management API. Every flag can also be set by the environment variable shown."
)


def build_parser() -> argparse.ArgumentParser:
    """``lorafleet-operator``'s flags: one per ``OperatorSettings`` field, and ``--verbose``."""
    return OperatorSettings.build_parser("lorafleet-operator", DESCRIPTION)


def parse_settings(argv: Sequence[str] | None = None) -> OperatorSettings:
    """Settings from the flags in ``argv`` and the environment; sets up logging (``--verbose``)."""
    return OperatorSettings.from_command_line(build_parser(), argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the DynamoModel operator until SIGTERM/SIGINT."""
    settings = parse_settings(argv)
    import kopf
    from lorafleet_sync.hf import HfSettings

    from lorafleet_operator import bootstrap_secrets, controller, metrics
    from lorafleet_operator.autoscale import Autoscaler
    from lorafleet_operator.kube import EventPoster, KubeClient
    from lorafleet_operator.leader import LEASE_NAME, LeaderElector, run_as_leader, standby_liveness
    from lorafleet_operator.ledger import ConfigMapLedger
    from lorafleet_operator.reconcile import Reconciler
    from lorafleet_operator.syncjob import SyncJobs
    from lorafleet_operator.workers import WorkerClient

    logging.getLogger(__name__).info("starting with %r", settings)
    metrics.serve(settings.metrics_port, settings.bind_host)

    async def main() -> int:
        """The operator until it stops; its exit status (3: leadership was lost)."""
        kube = KubeClient.from_environment()
        home = os.environ.get("POD_NAMESPACE") or (settings.namespaces or ("default",))[0]  # the operator's own
        events = EventPoster(kube, "lorafleet-operator")
        hf = HfSettings.from_env()
        if settings.hf_endpoint:
            hf = HfSettings(settings.hf_endpoint.rstrip("/"), hf.token)
        token = await bootstrap_secrets.bootstrap(kube, settings.token())  # GitOps: Secrets made at run time
        client = WorkerClient(
            token=token,
            load_timeout=settings.load_timeout,
            call_timeout=settings.call_timeout,
            max_concurrency=settings.max_concurrent_calls,
        )
        reconciler = Reconciler(
            client,
            default_replicas=settings.default_replicas,
            management_port=settings.management_port,
            sync=SyncJobs(kube, settings, hf, home) if settings.store_configured else None,
            emit=controller.event_sink(events),
            ledger=ConfigMapLedger(kube),
            listing_ttl=2 * settings.drift_interval,  # the drift pass refreshes every listing
            retry_max=settings.retry_max,
            unload_grace=settings.unload_grace,
            autoscaler=Autoscaler(cooldown=settings.autoscale_cooldown),
            balance=settings.balance,
            balance_epsilon=settings.balance_epsilon,
        )
        runtime = controller.Runtime(settings, reconciler, controller.kube_status_writer(kube), kube)
        liveness = f"http://{settings.bind_host}:{settings.liveness_port}/healthz" if settings.liveness_port else None

        async def operate() -> None:
            await kopf.operator(
                clusterwide=settings.all_namespaces,
                namespaces=() if settings.all_namespaces else settings.namespaces,
                standalone=not settings.peering,
                peering_name=settings.peering or None,
                liveness_endpoint=liveness,
                memo=kopf.Memo(runtime=runtime, kube=kube, events=events),
            )

        try:
            if settings.leader_elect:
                identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
                elector = LeaderElector(kube, home, LEASE_NAME, identity)
                async with standby_liveness(settings):
                    await elector.acquire()
                if not await run_as_leader(elector, operate):
                    return 3
            else:
                await operate()
            return 0
        finally:
            await kube.close()

    status = asyncio.run(main())
    if status:
        logging.getLogger(__name__).error("exiting with status %d: leadership lost (restarts as a candidate)", status)
        sys.exit(status)


if __name__ == "__main__":  # pragma: no cover
    main()
