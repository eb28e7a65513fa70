"""Secrets the operator writes, against a real kube-apiserver: generated ones (bootstrap_secrets:
created once, never changed, the same values for racing operators, the admin token read back) and
the store Secret's copies where sync Jobs run (store_credentials)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator

import pytest
from lorafleet_devcluster.session import TestCluster, shared_cluster
from lorafleet_operator import bootstrap_secrets as bs
from lorafleet_operator import store_credentials
from lorafleet_operator.kube import KubeClient

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


async def test_the_store_secret_is_copied_where_sync_jobs_run(cluster: TestCluster, kube: KubeClient) -> None:
    home, team, other = (cluster.new_namespace(p) for p in ("home", "team", "other"))
    keys = {"AWS_ACCESS_KEY_ID": "ak-1", "AWS_SECRET_ACCESS_KEY": "sk-1"}

    def put(ns: str, data: dict[str, str], version: str | None = None) -> None:
        body = {"metadata": {"name": "store", "resourceVersion": version}, "stringData": data}
        if version is None:
            cluster.kube.post(f"/api/v1/namespaces/{ns}/secrets", body)
        else:
            cluster.kube.put(f"/api/v1/namespaces/{ns}/secrets/store", body)

    def values(ns: str) -> dict[str, str]:
        data = cluster.get(f"/api/v1/namespaces/{ns}/secrets/store")["data"]
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    await store_credentials.ensure_copy(kube, "store", team, home)  # no source yet: nothing, no error
    assert not cluster.exists(f"/api/v1/namespaces/{team}/secrets/store")
    put(home, keys | {"unrelated": "x"})
    await store_credentials.ensure_copy(kube, "store", team, home)
    assert values(team) == keys, "only the store keys are copied"
    # Rotated keys reach the copy; a Secret of that name that someone else made is left alone.
    rotated = {"AWS_ACCESS_KEY_ID": "ak-2", "AWS_SECRET_ACCESS_KEY": "sk-2"}
    put(home, rotated, cluster.get(f"/api/v1/namespaces/{home}/secrets/store")["metadata"]["resourceVersion"])
    put(other, {"AWS_ACCESS_KEY_ID": "theirs", "AWS_SECRET_ACCESS_KEY": "theirs"})
    for ns in (team, other):
        await store_credentials.ensure_copy(kube, "store", ns, home)
    assert values(team) == rotated
    assert values(other)["AWS_ACCESS_KEY_ID"] == "theirs"
    await store_credentials.ensure_copy(kube, "store", home, home)  # its own namespace: the original
    assert values(home) == rotated


async def test_the_hf_token_secret_is_copied_where_sync_jobs_run(cluster: TestCluster, kube: KubeClient) -> None:
    """Sync Jobs of private hf:// repositories in another namespace read HF_TOKEN there."""
    home, team = cluster.new_namespace("home"), cluster.new_namespace("team")
    token = base64.b64encode(b"hf_private").decode()
    other = base64.b64encode(b"not copied").decode()
    cluster.kube.post(f"/api/v1/namespaces/{home}/secrets",
                      {"metadata": {"name": "hf"}, "data": {"HF_TOKEN": token, "extra": other}})  # fmt: skip
    await store_credentials.ensure_copy(kube, "hf", team, home, store_credentials.HF_KEYS)
    copy = cluster.get(f"/api/v1/namespaces/{team}/secrets/hf")
    assert copy["data"] == {"HF_TOKEN": token}, "only HF_TOKEN is copied"
    assert copy["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "lorafleet-operator"
    # the store keys are not what this copy carries
    await store_credentials.ensure_copy(kube, "hf", team, home)
    assert cluster.get(f"/api/v1/namespaces/{team}/secrets/hf")["data"] == {"HF_TOKEN": token}
