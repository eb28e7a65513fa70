"""Turning a pod spec into a local process: env, `$(VAR)` expansion, volumes and mount-path mapping.

Volumes are materialised under the pod's directory and each volumeMount maps
its `mountPath` to a host path. The mapping reaches the program in two ways:

* rewrite: every occurrence of a mount path (as a whole path prefix) in the
  container's command, args, env values and workingDir is replaced by the host
  path, e.g. `--cache-dir=/var/cache/lora/x` -> `--cache-dir=<pod>/volumes/cache/x`;
* env: `LORAFLEET_MOUNT_<PATH>` (mount path upper-cased, non-alphanumerics as `_`,
  e.g. `LORAFLEET_MOUNT_VAR_CACHE_LORA`) and `LORAFLEET_MOUNTS` (JSON object
  mount path -> host path) for programs that build paths themselves.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lorafleet_devcluster.kube import JSON, Kube, KubeError


class ConfigError(Exception):
    """The container cannot be configured yet (missing Secret/ConfigMap key, bad volume)."""

    reason = "CreateContainerConfigError"


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known vars substituted, unknown kept, `$$` -> `$`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def _safe_join(base: Path, rel: str) -> Path:
    """`base/rel`, refusing absolute paths and `..` escapes."""
    target = (base / rel).resolve()
    if rel.startswith("/") or not target.is_relative_to(base.resolve()):
        raise ConfigError(f"path {rel!r} escapes its volume")
    return target


# -- field references --------------------------------------------------------------------------------
_LABEL_REF = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


def field_ref(pod: JSON, path: str, pod_ip: str, host_ip: str) -> str:
    """The value of a downward-API `fieldRef.fieldPath` for this pod."""
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    m = _LABEL_REF.fullmatch(path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1], {})
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise ConfigError(f"unsupported fieldRef {path!r}")


# -- Secrets and ConfigMaps -----------------------------------------------------------------------------
class ObjectReader:
    """Reads (and caches for one container start) Secrets and ConfigMaps as `{key: bytes}`."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self._kube, self._ns = kube, namespace
        self._cache: dict[tuple[str, str], dict[str, bytes] | None] = {}

    def data(self, kind: str, name: str) -> dict[str, bytes] | None:
        """`kind` is `secrets` or `configmaps`; None when the object does not exist."""
        key = (kind, name)
        if key not in self._cache:
            try:
                obj = self._kube.get(f"/api/v1/namespaces/{self._ns}/{kind}/{name}")
            except KubeError as exc:
                if exc.status != 404:
                    raise
                self._cache[key] = None
            else:
                out = (
                    {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
                    if kind == "secrets"
                    else {k: v.encode() for k, v in (obj.get("data") or {}).items()}
                )
                out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
                self._cache[key] = out
        return self._cache[key]

    def key(self, kind: str, ref: JSON) -> str | None:
        """Resolve a `secretKeyRef`/`configMapKeyRef` (None if optional and missing)."""
        data = self.data(kind, ref["name"])
        if data is None or ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise ConfigError(f"{kind[:-1]} {ref['name']!r} (key {ref['key']!r}) not found")
        return data[ref["key"]].decode()


# -- environment ------------------------------------------------------------------------------------------
FieldResolver = Callable[[str], str]


def container_env(
    container: JSON, base: Mapping[str, str], reader: ObjectReader, fields: FieldResolver
) -> dict[str, str]:
    """The variables envFrom + env of one container define (`$(VAR)` expanded against `base` and earlier ones)."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        prefix = src.get("prefix", "")
        kind, ref = ("secrets", src["secretRef"]) if "secretRef" in src else ("configmaps", src["configMapRef"])
        data = reader.data(kind, ref["name"])
        if data is None:
            if ref.get("optional"):
                continue
            raise ConfigError(f"{kind[:-1]} {ref['name']!r} not found (envFrom)")
        env.update({prefix + k: v.decode() for k, v in data.items()})
    for var in container.get("env", []):
        value: str | None
        if "valueFrom" not in var:
            value = expand(var.get("value", ""), {**base, **env})
        else:
            source = var["valueFrom"]
            if "fieldRef" in source:
                value = fields(source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source:
                value = reader.key("secrets", source["secretKeyRef"])
            elif "configMapKeyRef" in source:
                value = reader.key("configmaps", source["configMapKeyRef"])
            else:
                raise ConfigError(f"env {var['name']}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[var["name"]] = value
    return env


# -- volumes and mounts ---------------------------------------------------------------------------------------
def _write_items(target: Path, data: Mapping[str, bytes], items: Sequence[JSON] | None, mode: int | None) -> None:
    target.mkdir(parents=True, exist_ok=True)
    pairs = [(i["key"], i["path"], i.get("mode")) for i in items] if items else [(k, k, None) for k in data]
    for key, rel, item_mode in pairs:
        if key not in data:
            raise ConfigError(f"key {key!r} not found for volume item {rel!r}")
        path = _safe_join(target, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[key])
        path.chmod(item_mode or mode or 0o644)


@dataclass
class VolumeContext:
    """What materialising volumes needs besides the spec."""

    reader: ObjectReader
    fields: FieldResolver
    token: Callable[[str | None, int | None], str]  # (audience, expirationSeconds) -> token
    ca_pem: bytes
    shared_claims: Path  # PVC directories live here, keyed by namespace/claim


def materialise_volumes(pod: JSON, root: Path, ctx: VolumeContext) -> dict[str, Path]:
    """Create every volume of `pod` under `root`; returns volume name -> host directory."""
    out: dict[str, Path] = {}
    for vol in pod["spec"].get("volumes", []):
        name = vol["name"]
        target = root / name
        if "emptyDir" in vol:
            target.mkdir(parents=True, exist_ok=True)
        elif "secret" in vol or "configMap" in vol:
            kind, src = ("secrets", vol["secret"]) if "secret" in vol else ("configmaps", vol["configMap"])
            obj_name = src.get("secretName") or src.get("name")
            data = ctx.reader.data(kind, obj_name)
            if data is None and not src.get("optional"):
                raise ConfigError(f"volume {name}: {kind[:-1]} {obj_name!r} not found")
            _write_items(target, data or {}, src.get("items"), src.get("defaultMode"))
        elif "projected" in vol:
            _projected(vol["projected"], target, ctx)
        elif "downwardAPI" in vol:
            _downward(vol["downwardAPI"].get("items", []), target, ctx)
        elif "hostPath" in vol:
            target = Path(vol["hostPath"]["path"])
        elif "persistentVolumeClaim" in vol:
            target = ctx.shared_claims / pod["metadata"]["namespace"] / vol["persistentVolumeClaim"]["claimName"]
            target.mkdir(parents=True, exist_ok=True)
        else:
            raise ConfigError(f"volume {name}: unsupported type {sorted(k for k in vol if k != 'name')}")
        out[name] = target
    return out


def _downward(items: Sequence[JSON], target: Path, ctx: VolumeContext) -> None:
    data = {i["path"]: ctx.fields(i["fieldRef"]["fieldPath"]).encode() for i in items if "fieldRef" in i}
    _write_items(target, data, None, None)


def _projected(spec: JSON, target: Path, ctx: VolumeContext) -> None:
    target.mkdir(parents=True, exist_ok=True)
    mode = spec.get("defaultMode")
    for source in spec.get("sources", []):
        if "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            token = ctx.token(sat.get("audience"), sat.get("expirationSeconds"))
            _write_items(target, {sat["path"]: token.encode()}, None, mode)
        elif "configMap" in source or "secret" in source:
            kind, src = ("configmaps", source["configMap"]) if "configMap" in source else ("secrets", source["secret"])
            data = ctx.reader.data(kind, src["name"])
            if data is None and not src.get("optional"):
                raise ConfigError(f"projected {kind[:-1]} {src['name']!r} not found")
            _write_items(target, data or {}, src.get("items"), mode)
        elif "downwardAPI" in source:
            _downward(source["downwardAPI"].get("items", []), target, ctx)
        else:
            raise ConfigError(f"unsupported projected source {sorted(source)}")


def mount_map(container: JSON, volumes: Mapping[str, Path]) -> dict[str, str]:
    """mountPath -> host path for one container (subPath honoured)."""
    out: dict[str, str] = {}
    for m in container.get("volumeMounts", []):
        if m["name"] not in volumes:
            raise ConfigError(f"volumeMount {m['mountPath']}: no volume {m['name']!r}")
        host = volumes[m["name"]]
        if m.get("subPath"):
            host = _safe_join(host, m["subPath"])
            if not host.exists():  # the kubelet creates a missing subPath as a directory
                host.mkdir(parents=True)
        out[m["mountPath"].rstrip("/") or "/"] = str(host)
    return out


def rewriter(mounts: Mapping[str, str]) -> Callable[[str], str]:
    """A function replacing mount paths (longest first, whole path prefixes only) by host paths."""
    if not mounts:
        return lambda s: s
    alternatives = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w./-])({alternatives})(?=/|$|[^\w.-])")
    return lambda s: pattern.sub(lambda m: mounts[m.group(1)], s)


def mount_env(mounts: Mapping[str, str]) -> dict[str, str]:
    """`LORAFLEET_MOUNT_<PATH>` per mount plus `LORAFLEET_MOUNTS` (JSON)."""
    env = {"LORAFLEET_MOUNT_" + re.sub(r"[^A-Za-z0-9]", "_", p.strip("/")).upper(): h for p, h in mounts.items()}
    env["LORAFLEET_MOUNTS"] = json.dumps(dict(mounts), sort_keys=True)
    return env
