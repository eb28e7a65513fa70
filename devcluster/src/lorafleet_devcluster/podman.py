"""Container mode of the node agent: a pod's container run from its image with podman.

`LORAFLEET_NODE_RUNTIME=podman` makes the agent run every container whose image is a lorafleet image
(`lorafleet/operator`, `lorafleet/worker`, ...) with `podman run`; other images (`minio/minio`,
`busybox`, `python`) stay local processes, as in the default process mode (no registry is reachable
here to pull them). What the kubelet would do, podman does:

* command/args replace the image's ENTRYPOINT/CMD as in Kubernetes; env goes in through an env file
  (0600, never on the command line or in the log);
* volumes are bind mounts of the directories the agent materialises (secret, configMap, projected and
  downwardAPI mounts read-only; `readOnly: true` honoured); emptyDirs are world-writable, as the
  kubelet makes them;
* `securityContext` (pod, then container): runAsUser/runAsGroup, runAsNonRoot (refused for uid 0),
  readOnlyRootFilesystem (no tmpfs added), capabilities drop/add, allowPrivilegeEscalation=false
  (no-new-privileges); `resources.limits` cpu and memory;
* the network is the host's (`--network host`), the program listens on its pod's own 127.0.x.y
  (`POD_IP`): only loopback addresses carry test traffic here, never a bridge network;
* the pod's ServiceAccount kubeconfig is mounted read-only at /var/run/lorafleet/kubeconfig.

podman is configured through `CONTAINERS_CONF` ($LORAFLEET_CACHE/podman/containers.conf by default,
written by `make images`: runc, cgroupfs, no default ulimits).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from lorafleet_devcluster import images
from lorafleet_devcluster.kube import JSON
from lorafleet_devcluster.paths import cache_dir
from lorafleet_devcluster.podspec import ConfigError

RUNTIME_ENV = "LORAFLEET_NODE_RUNTIME"
KUBECONFIG_PATH = "/var/run/lorafleet/kubeconfig"
READ_ONLY_VOLUMES = ("secret", "configMap", "projected", "downwardAPI")
_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_UNITS = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3}


def enabled() -> bool:
    """The agent runs lorafleet images with podman (`LORAFLEET_NODE_RUNTIME=podman`)."""
    mode = os.environ.get(RUNTIME_ENV, "process")
    if mode not in ("process", "podman"):
        raise ValueError(f"{RUNTIME_ENV}={mode!r}: want 'process' or 'podman'")
    return mode == "podman"


def runs_in_container(image: str) -> bool:
    """Container mode is on and `image` is a lorafleet image (`[registry/]lorafleet/NAME[:tag]`)."""
    parts = images.repository(image).split("/")
    return enabled() and len(parts) >= 2 and parts[-2] == "lorafleet"


def podman_env() -> dict[str, str]:
    """The environment podman itself runs with (the host's, plus the containers.conf `make images` wrote)."""
    env = dict(os.environ)
    conf = cache_dir() / "podman" / "containers.conf"
    if "CONTAINERS_CONF" not in env and conf.exists():
        env["CONTAINERS_CONF"] = str(conf)
    return env


def podman() -> str:
    found = shutil.which("podman")
    if not found:
        raise images.ImageError("container mode needs podman on PATH (make images installs it where it can)")
    return found


def require_image(image: str) -> None:
    """ErrImagePull (as the kubelet would report it) unless the image exists locally."""
    done = subprocess.run([podman(), "image", "exists", image], env=podman_env(), capture_output=True, timeout=60)
    if done.returncode != 0:
        raise images.ImageError(f"image {image!r} is not in podman's local storage: build it with `make images`")


def quantity(text: str | int | float) -> float:
    """A Kubernetes quantity ("500m", "2Gi", "1.5") as a number (cores or bytes)."""
    match = _QUANTITY.match(str(text))
    if not match or match.group(2) not in _UNITS:
        raise ConfigError(f"unsupported quantity {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def security_args(pod: JSON, container: JSON) -> list[str]:
    """podman flags for the pod's and the container's securityContext (the container's wins)."""
    sc = {**(pod["spec"].get("securityContext") or {}), **(container.get("securityContext") or {})}
    out: list[str] = []
    if "runAsUser" in sc:
        if sc.get("runAsNonRoot") and int(sc["runAsUser"]) == 0:
            raise ConfigError("container has runAsNonRoot and runAsUser 0")
        out += ["--user", f"{int(sc['runAsUser'])}:{int(sc.get('runAsGroup', sc['runAsUser']))}"]
    elif "runAsGroup" in sc:
        raise ConfigError("runAsGroup without runAsUser is not supported by the dev cluster's podman mode")
    if sc.get("fsGroup") is not None or sc.get("supplementalGroups"):
        for gid in [sc.get("fsGroup"), *(sc.get("supplementalGroups") or [])]:
            if gid is not None:
                out += ["--group-add", str(int(gid))]
    if sc.get("readOnlyRootFilesystem"):
        out += ["--read-only", "--read-only-tmpfs=false"]
    caps = sc.get("capabilities") or {}
    out += [arg for cap in caps.get("drop", []) for arg in ("--cap-drop", str(cap))]
    out += [arg for cap in caps.get("add", []) for arg in ("--cap-add", str(cap))]
    if sc.get("allowPrivilegeEscalation") is False:
        out += ["--security-opt", "no-new-privileges"]
    if sc.get("privileged"):
        raise ConfigError("privileged containers are not run by the dev cluster")
    return out


def resource_args(container: JSON) -> list[str]:
    limits = (container.get("resources") or {}).get("limits") or {}
    out: list[str] = []
    if "cpu" in limits:
        out += ["--cpus", f"{quantity(limits['cpu']):g}"]
    if "memory" in limits:
        out += ["--memory", str(int(quantity(limits["memory"])))]
    return out


def volume_args(pod: JSON, container: JSON, volumes: Mapping[str, Path], mounts: Mapping[str, str]) -> list[str]:
    """`-v host:path[:ro]` per volumeMount; emptyDirs and claims made world-writable as the kubelet does."""
    kinds = {v["name"]: next(k for k in v if k != "name") for v in pod["spec"].get("volumes", [])}
    out: list[str] = []
    for m in container.get("volumeMounts", []):
        kind = kinds[m["name"]]
        host = mounts[m["mountPath"].rstrip("/") or "/"]
        if kind in ("emptyDir", "persistentVolumeClaim"):
            Path(host).chmod(0o777)
        read_only = m.get("readOnly") or kind in READ_ONLY_VOLUMES
        out += ["-v", f"{host}:{m['mountPath']}" + (":ro" if read_only else "")]
    return out


def write_env_file(path: Path, env: Mapping[str, str]) -> tuple[Path, list[str]]:
    """The container env as a 0600 env file; names of multi-line values (passed via podman's env) apart."""
    lines, multiline = [], []
    for key, value in env.items():
        if "\n" in value:
            multiline.append(key)
        else:
            lines.append(f"{key}={value}")
    path.touch(mode=0o600)
    path.write_text("\n".join(lines) + "\n")
    return path, multiline


def run_argv(
    *,
    name: str,
    image: str,
    command: Sequence[str],
    args: Sequence[str],
    env_file: Path,
    env_names: Sequence[str],
    extra: Sequence[str],
    workdir: str | None,
) -> list[str]:
    """The `podman run` argv for one container (Kubernetes' command/args semantics)."""
    argv = [podman(), "run", "--rm", "--name", name, "--pull", "never", "--network", "host", "--init=false"]
    argv += ["--env-file", str(env_file), *(a for n in env_names for a in ("--env", n)), *extra]
    if workdir:
        argv += ["--workdir", workdir]
    if command:
        argv += ["--entrypoint", command[0], image, *command[1:], *args]
    else:
        argv += [image, *args]
    return argv


def exec_argv(name: str, command: Sequence[str]) -> list[str]:
    """An exec probe's command inside the running container."""
    return [podman(), "exec", name, *command]


def remove(name: str) -> None:
    """Remove the container if it is still there (after its `podman run` was killed)."""
    subprocess.run(
        [podman(), "rm", "--force", "--ignore", "--time", "0", name],
        env=podman_env(),
        capture_output=True,
        timeout=60,
    )
