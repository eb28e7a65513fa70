"""Run-time generated Secrets (bootstrap_secrets) against a real kube-apiserver: created once,
never changed afterwards, the same values for racing operators, the admin token read back."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator

import pytest
from lorafleet_operator import bootstrap_secrets as bs
from lorafleet_operator.kube import KubeClient

from tests.infra.session import TestCluster, shared_cluster

WANTED = {"tok": {"token": 48}, "keys": {"AWS_ACCESS_KEY_ID": 20, "AWS_SECRET_ACCESS_KEY": 40}}


@pytest.fixture(scope="module")
def cluster() -> Iterator[TestCluster]:
    with shared_cluster() as handle:
        yield handle


@pytest.fixture
async def kube(cluster: TestCluster, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeClient]:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    client = KubeClient.from_environment()
    yield client
    await client.close()


def env(namespace: str) -> dict[str, str]:
    return {bs.SECRETS_ENV: json.dumps(WANTED), bs.ADMIN_TOKEN_ENV: "tok/token", "POD_NAMESPACE": namespace}


async def test_created_once_then_never_changed(cluster: TestCluster, kube: KubeClient) -> None:
    ns = cluster.new_namespace("boot")
    # Two operators starting at once (a rollout overlap) agree on one value.
    first, second = await asyncio.gather(bs.bootstrap(kube, None, env(ns)), bs.bootstrap(kube, None, env(ns)))
    assert first == second and first is not None and len(first) == 48 and first.isalnum()
    keys = cluster.get(f"/api/v1/namespaces/{ns}/secrets/keys")
    values = {k: base64.b64decode(v).decode() for k, v in keys["data"].items()}
    assert {k: len(v) for k, v in values.items()} == {"AWS_ACCESS_KEY_ID": 20, "AWS_SECRET_ACCESS_KEY": 40}
    assert keys["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "lorafleet-operator",
        "app.kubernetes.io/part-of": "lorafleet",
    }
    # A restart finds them: same token, Secrets untouched.
    assert await bs.bootstrap(kube, None, env(ns)) == first
    assert (
        cluster.get(f"/api/v1/namespaces/{ns}/secrets/keys")["metadata"]["resourceVersion"]
        == (keys["metadata"]["resourceVersion"])
    )
    # A token given in the settings wins; nothing to generate leaves everything alone.
    assert await bs.bootstrap(kube, "given", env(ns)) == "given"
    assert await bs.bootstrap(kube, None, {"POD_NAMESPACE": ns}) is None


async def test_an_existing_secret_is_used_as_it_is(cluster: TestCluster, kube: KubeClient) -> None:
    ns = cluster.new_namespace("boot")
    data = {"token": base64.b64encode(b"mine").decode()}
    cluster.kube.post(f"/api/v1/namespaces/{ns}/secrets", {"metadata": {"name": "tok"}, "data": data})
    assert await bs.bootstrap(kube, None, env(ns)) == "mine"
    assert cluster.get(f"/api/v1/namespaces/{ns}/secrets/tok")["data"] == data


@pytest.mark.parametrize("raw", ["not json", '{"s": {"k": 4}}', '{"s": {}}', '["s"]', '{"s": {"k": "48"}}'])
def test_bad_specs_are_refused_with_the_variable_named(raw: str) -> None:
    with pytest.raises(ValueError, match=bs.SECRETS_ENV):
        bs.parse_wanted(raw)
