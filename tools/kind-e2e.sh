#!/usr/bin/env bash
# `make e2e-kind`: the chart e2e on a kind cluster (a real node: kubelet, containerd, kube-proxy, CoreDNS).
#
#   tools/kind-e2e.sh [PYTEST-ARGS...]     # default: the chart e2e files (KIND_E2E_TESTS)
#   tools/kind-e2e.sh --cleanup            # only remove what an earlier (crashed) run left behind
#
# With docker, kind runs as usual. Without it (this project's machines), kind's podman provider runs,
# and everything the cluster owns lives in a network namespace this script creates (`ip netns add`,
# entered with `nsenter --net=`, which keeps the host's /sys and its cgroup mounts): the podman network,
# the node's, pods' and Services' addresses, and the tests themselves, which reach the API server and
# Services through the namespace's loopback (kind's port mapping, `kubectl port-forward`). The node
# image is the official one where it can be pulled, else the local one (tools/kind-node.sh); kind never
# falls back to its default image, since --image is always given.
#
# Cleanup runs on every exit and before every run: the cluster, the podman network, the namespace, the
# host sysctls kubelet sets (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops: not namespaced,
# so saved before and restored after), the empty /lib/modules kind's podman provider mounts, and the
# /run/netns mount `ip netns add` makes (when this run made it).
set -euo pipefail
cd "$(dirname "$0")/.."
here="$PWD/tools"
# shellcheck source=go-tools.versions
source "$here/go-tools.versions"
CACHE="${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}"
BIN="$CACHE/bin"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$CACHE/podman/containers.conf}"
CLUSTER="${KIND_CLUSTER:-lorafleet-e2e}"
NETNS="${KIND_NETNS:-lorafleet-kind}"
STATE="$CACHE/kind-run"          # what a run changed on the host, so that any later run can undo it
IMAGE_TAG="${IMAGE_TAG:-dev}"
PY="${PY:-.venv/bin/python}"
KIND="$BIN/kind-$KIND_VERSION/kind"
KUBECTL="$BIN/kubectl-$KUBERNETES_VERSION"
OFFICIAL_NODE="docker.io/kindest/node:$KUBERNETES_VERSION"
MINIO_BIN="$(ls "$BIN"/minio-* 2>/dev/null | head -1 || true)"
MINIO_IMAGE="localhost/lorafleet/minio:${MINIO_BIN##*/minio-}"
log() { printf '==> [e2e-kind] %s\n' "$*" >&2; }

engine="$(tools/container-engine.sh)"
in_ns() { if [ "$engine" = podman ]; then nsenter --net="/run/netns/$NETNS" -- "$@"; else "$@"; fi; }
image_exists() { "$engine" image inspect "$1" >/dev/null 2>&1; }
save_images() {  # save_images ARCHIVE IMAGE... : one docker-archive with every image
  local out="$1"; shift
  if [ "$engine" = podman ]; then podman save -q -m --format docker-archive -o "$out" "$@"; else docker save -o "$out" "$@"; fi
}
kind_() { in_ns env KIND_EXPERIMENTAL_PROVIDER="$engine" "$KIND" "$@"; }

cleanup() {
  local rc=$?
  set +e
  if [ "$engine" = podman ] && [ -e "/run/netns/$NETNS" ]; then
    kind_ delete cluster --name "$CLUSTER" >/dev/null 2>&1
    in_ns podman network rm -f kind >/dev/null 2>&1
    ip netns del "$NETNS"
    log "cleanup: cluster $CLUSTER and network namespace $NETNS removed"
  elif [ "$engine" = docker ]; then
    kind_ delete cluster --name "$CLUSTER" >/dev/null 2>&1
  fi
  if [ -s "$STATE/sysctls" ]; then
    while read -r key value; do sysctl -qw "$key=$value"; done <"$STATE/sysctls"
    log "cleanup: host sysctls restored ($(tr '\n' ' ' <"$STATE/sysctls"))"
  fi
  if [ -e "$STATE/created-lib-modules" ]; then rmdir /lib/modules 2>/dev/null && log "cleanup: /lib/modules removed"; fi
  # `ip netns add` mounts /run/netns on first use; unmount it if this run did and nothing else is in it.
  if [ -e "$STATE/created-run-netns" ] && [ -z "$(ls -A /run/netns 2>/dev/null)" ]; then
    umount /run/netns 2>/dev/null && rmdir /run/netns && log "cleanup: /run/netns unmounted"
  fi
  rm -rf "$STATE"
  return $rc
}

if [ "${1:-}" = --cleanup ]; then cleanup; exit; fi
tests=("$@")
[ ${#tests[@]} -gt 0 ] || read -ra tests <<<"${KIND_E2E_TESTS:-tests/e2e/test_chart_install.py tests/e2e/test_chart_autoscale.py tests/e2e/test_restricted_namespace.py}"
cleanup   # a crashed run's leftovers
trap cleanup EXIT
trap 'exit 130' INT TERM

# -- tools and images ----------------------------------------------------------------------------------------
tools/build-go-tools.sh kubernetes etcd helm kind >&2
if [ "$engine" = docker ] && docker pull -q "$OFFICIAL_NODE" >/dev/null 2>&1; then
  node_image="$OFFICIAL_NODE"
else
  node_image="$(tools/kind-node.sh | tail -1)"
fi
log "node image: $node_image"
tools/images.sh operator worker-dev >&2
if ! image_exists "$MINIO_IMAGE"; then   # the chart's MinIO, from the Go-built server
  [ -x "$MINIO_BIN" ] || { log "no MinIO server in $BIN: run make setup"; exit 1; }
  dir="$(mktemp -d)"; mkdir -p "$dir/usr/local/bin" "$dir/tmp"; cp "$MINIO_BIN" "$dir/usr/local/bin/minio"
  tar -C "$dir" --owner=0 --group=0 -c . | "$engine" import --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
    --change 'ENTRYPOINT ["minio"]' - "$MINIO_IMAGE" >/dev/null
  rm -rf "$dir"
fi

# -- the cluster -------------------------------------------------------------------------------------------------
mkdir -p "$STATE"
for key in vm.overcommit_memory kernel.panic kernel.panic_on_oops; do echo "$key $(sysctl -n "$key")"; done >"$STATE/sysctls"
if [ "$engine" = podman ]; then
  [ -e /lib/modules ] || { mkdir /lib/modules && touch "$STATE/created-lib-modules"; }
  mountpoint -q /run/netns || touch "$STATE/created-run-netns"
  ip netns add "$NETNS"
  in_ns ip link set lo up
fi
cat >"$STATE/cluster.yaml" <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
networking:
  # kindnetd is a registry image: the local node image carries a static ptp CNI config instead.
  disableDefaultCNI: $([ "$node_image" = "$OFFICIAL_NODE" ] && echo false || echo true)
nodes:
  - role: control-plane
kubeadmConfigPatches:
  - |
    kind: KubeletConfiguration
    failCgroupV1: false
  - |
    kind: ClusterConfiguration
    etcd:
      local:
        imageTag: "${ETCD_VERSION#v}-0"
    dns:
      imageTag: "$COREDNS_VERSION"
EOF
[ "$node_image" = "$OFFICIAL_NODE" ] && sed -i '/^kubeadmConfigPatches:/,$d' "$STATE/cluster.yaml"
# what the node will have (a CI failure's first question): memory and the image store's free disk
store="$(tools/image-store.sh "$engine")"
log "host: $(awk '/MemAvailable/ {printf "%.1f", $2 / 1048576}' /proc/meminfo) GiB memory available," \
  "$(df -h --output=avail "$store" 2>/dev/null | tail -1 | tr -d ' ') free for images ($store)"
log "kind create cluster $CLUSTER"
kind_ create cluster --name "$CLUSTER" --image "$node_image" --config "$STATE/cluster.yaml" \
  --kubeconfig "$STATE/kubeconfig" --wait 300s
# The chart names lorafleet/...: docker.io/lorafleet/... to containerd, localhost/lorafleet/... to podman.
archive="$STATE/images.tar"
images=("docker.io/lorafleet/operator:$IMAGE_TAG" "docker.io/lorafleet/worker:$IMAGE_TAG-dev" "$MINIO_IMAGE")
[ "$engine" = docker ] || for i in 0 1; do "$engine" tag "${images[$i]/#docker.io/localhost}" "${images[$i]}"; done
log "kind load image-archive: ${images[*]}"
save_images "$archive" "${images[@]}"
[ "$engine" = docker ] || for i in 0 1; do "$engine" untag "${images[$i]}" "${images[$i]}"; done
kind_ load image-archive --name "$CLUSTER" "$archive"
rm -f "$archive"

# -- the tests ------------------------------------------------------------------------------------------------------
# Test servers the pods must reach (the Hub stand-in) listen on the kind network's gateway.
gateway="$(in_ns "$engine" network inspect kind --format '{{range .Subnets}}{{.Gateway}} {{end}}' |
  tr ' ' '\n' | grep -F . | head -1)"
log "pytest (test servers for pods on $gateway)"
rc=0
in_ns env LORAFLEET_E2E_CLUSTER=kubeconfig KUBECONFIG="$STATE/kubeconfig" LORAFLEET_E2E_HOST_ADDRESS="$gateway" \
  LORAFLEET_E2E_MINIO_IMAGE="$MINIO_IMAGE" IMAGE_TAG="$IMAGE_TAG" \
  "$PY" -m pytest "${tests[@]}" || rc=$?
if [ "$rc" -ne 0 ]; then   # CI keeps a log's tail: the cluster as the failure left it, last
  log "pytest failed (exit $rc); the node and every pod now:"
  in_ns "$KUBECTL" --kubeconfig "$STATE/kubeconfig" get nodes,pods --all-namespaces -o wide >&2 || true
  in_ns "$KUBECTL" --kubeconfig "$STATE/kubeconfig" get events --all-namespaces --field-selector type=Warning \
    --sort-by .lastTimestamp 2>/dev/null | tail -15 >&2 || true
fi
exit "$rc"
