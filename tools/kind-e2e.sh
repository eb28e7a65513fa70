#!/usr/bin/env bash
# `make e2e-kind`: the chart e2e on a kind cluster (a real node: kubelet, containerd, kube-proxy, CoreDNS).
# `make e2e-kind-multinode`: the same with KIND_WORKERS=2: a control plane and two worker nodes.
#
#   tools/kind-e2e.sh [PYTEST-ARGS...]     # default: the chart e2e files (KIND_E2E_TESTS)
#   tools/kind-e2e.sh --cleanup            # only remove what an earlier (crashed) run left behind
#
# KIND_WORKERS=N (default 0): N worker nodes besides the control plane (which then runs no chart pod).
# KIND_CNI: the pod network. `ptp` (the default with no workers): the static config the local node image
# carries, one node only, no NetworkPolicy. `kube-router` (the default with workers): routes between the
# nodes and NetworkPolicy enforced (tools/cni-kube-router.sh). With the official image (docker), kind's
# own kindnetd. The tests learn the nodes and whether policies are enforced from LORAFLEET_E2E_KIND_*.
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
WORKERS="${KIND_WORKERS:-0}"
CNI="${KIND_CNI:-}"
KIND="$BIN/kind-$KIND_VERSION/kind"
KUBECTL="$BIN/kubectl-$KUBERNETES_VERSION"
OFFICIAL_NODE="docker.io/kindest/node:$KUBERNETES_VERSION"
MINIO_BIN="$(ls "$BIN"/minio-* 2>/dev/null | head -1 || true)"
MINIO_IMAGE="localhost/lorafleet/minio:${MINIO_BIN##*/minio-}"
log() { printf '==> [e2e-kind] %s\n' "$*" >&2; }

engine="$(tools/container-engine.sh)"
in_ns() { if [ "$engine" = podman ]; then nsenter --net="/run/netns/$NETNS" -- "$@"; else "$@"; fi; }
image_exists() { "$engine" image inspect "$1" >/dev/null 2>&1; }
save_images() {  # save_images IMAGE... : one docker-archive with every image, on stdout
  if [ "$engine" = podman ]; then podman save -q -m --format docker-archive "$@"; else docker save "$@"; fi
}
# load_images NODE... : the images in ${images[@]} into each node's containerd, one node at a time, streamed
# (no archive on disk), as `kind load` imports them; then the layer blobs go (what containerd's
# discard_unpacked_layers does for pulled images), so a node holds one copy of the worker image, not two.
node_ctr() { local node="$1"; shift; in_ns "$engine" exec -i "$node" ctr --namespace=k8s.io "$@"; }
layers() {  # layers NODE DIGEST : the layer digests of manifest DIGEST (or of each manifest of an index)
  local kind digest
  while read -r kind digest; do
    if [ "$kind" = m ]; then layers "$1" "$digest"; else echo "$digest"; fi
  done < <(node_ctr "$1" content get "$2" 2>/dev/null | "$PY" -c 'import json, sys
doc = json.load(sys.stdin)
for kind, key in (("m", "manifests"), ("l", "layers")):
    for entry in doc.get(key, []):
        print(kind, entry["digest"])')
}
load_images() {
  local node ref digest blobs
  for node in "$@"; do
    save_images "${images[@]}" | node_ctr "$node" images import --all-platforms --digests --snapshotter=overlayfs - >/dev/null
    for ref in "${images[@]}"; do
      digest="$(node_ctr "$node" images ls | awk -v ref="$ref" '$1 == ref {print $3}')"
      [ -n "$digest" ] || { log "$ref is not in $node after the import"; return 1; }
      mapfile -t blobs < <(layers "$node" "$digest")
      [ ${#blobs[@]} -eq 0 ] || node_ctr "$node" content rm "${blobs[@]}" >/dev/null
    done
  done
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
started=$SECONDS

refuse() { log "cannot run here: $*"; exit 2; }
# A multi-node cluster: memory for the nodes and the chart; kube-router's kernel features (its policies are
# iptables rules matching ipsets, its pods sit on a bridge whose traffic iptables must see).
if [ "$WORKERS" -gt 0 ]; then
  need_gib=$((3 + 2 * WORKERS))
  have_kib="$(awk '/MemAvailable/ {print $2}' /proc/meminfo)"
  [ "$have_kib" -ge $((need_gib * 1048576)) ] ||
    refuse "$WORKERS worker nodes need about $need_gib GiB of available memory, this machine has $((have_kib / 1048576)) GiB"
  if [ "$engine" = podman ] && [ "${CNI:-kube-router}" = kube-router ] && [ -r /proc/config.gz ]; then
    for opt in CONFIG_IP_SET CONFIG_NETFILTER_XT_SET CONFIG_BRIDGE CONFIG_BRIDGE_NETFILTER; do
      zgrep -qE "^$opt=(y|m)" /proc/config.gz || refuse "KIND_CNI=kube-router needs a kernel with $opt (/proc/config.gz)"
    done
  fi
fi
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
if [ "$node_image" = "$OFFICIAL_NODE" ]; then
  CNI="${CNI:-kindnet}"
  [ "$CNI" = kindnet ] || refuse "KIND_CNI=$CNI: the official node image runs kind's own kindnetd"
else
  [ -n "$CNI" ] || { [ "$WORKERS" -gt 0 ] && CNI=kube-router || CNI=ptp; }
  case "$CNI" in
    ptp) [ "$WORKERS" -eq 0 ] || refuse "KIND_CNI=ptp is one node's static network (use kube-router)" ;;
    kube-router)
      cni_image="$(tools/cni-kube-router.sh image | tail -1)"
      log "network: kube-router ($cni_image)" ;;
    *) refuse "KIND_CNI=$CNI: ptp or kube-router with the local node image" ;;
  esac
fi
# KIND_IMAGES=keep: run the images as they are (iterating on the cluster while the sources change).
if [ "${KIND_IMAGES:-build}" = keep ] && image_exists "localhost/lorafleet/operator:$IMAGE_TAG" &&
  image_exists "localhost/lorafleet/worker:$IMAGE_TAG-dev"; then
  log "KIND_IMAGES=keep: the existing operator and worker-dev images, not rebuilt"
else
  tools/images.sh operator worker-dev >&2
fi
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
node_entry() {  # node_entry ROLE NAME: one node of the cluster config
  echo "  - role: $1"
  # kube-router: each node's /etc/cni/net.d starts empty (the image's ptp config would give every node the
  # same pod subnet); kube-router's DaemonSet writes the node's own config there.
  [ "$CNI" != kube-router ] || printf '    extraMounts:\n      - {hostPath: %s, containerPath: /etc/cni/net.d}\n' \
    "$(mkdir -p "$STATE/cni/$2" && echo "$STATE/cni/$2")"
}
cat >"$STATE/cluster.yaml" <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
networking:
  # kindnetd is a registry image: the local node image carries a static ptp CNI config instead.
  disableDefaultCNI: $([ "$CNI" = kindnet ] && echo false || echo true)
nodes:
$(node_entry control-plane control-plane; for i in $(seq 1 "$WORKERS"); do node_entry worker "worker$i"; done)
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
kubectl_() { in_ns "$KUBECTL" --kubeconfig "$STATE/kubeconfig" "$@"; }
log "kind create cluster $CLUSTER (1 control plane, $WORKERS workers, network: $CNI)"
# Nodes are Ready once their network is: with kube-router that comes after creation, so kind does not wait.
wait_flag=(--wait 300s); [ "$CNI" != kube-router ] || wait_flag=()
kind_ create cluster --name "$CLUSTER" --image "$node_image" --config "$STATE/cluster.yaml" \
  --kubeconfig "$STATE/kubeconfig" "${wait_flag[@]}"
workers=(); [ "$WORKERS" -eq 0 ] || mapfile -t workers < <(kind_ get nodes --name "$CLUSTER" | grep -v -- -control-plane$ | sort)
if [ "$CNI" = kube-router ]; then
  log "kube-router: loading its image into every node, applying its DaemonSet"
  images=("$cni_image"); load_images $(kind_ get nodes --name "$CLUSTER")
  tools/cni-kube-router.sh manifest "$cni_image" | kubectl_ apply -f - >/dev/null
  kubectl_ wait --for=condition=Ready node --all --timeout=300s >&2
  kubectl_ -n kube-system rollout status deployment/coredns --timeout=180s >&2
fi
# The chart names lorafleet/...: docker.io/lorafleet/... to containerd, localhost/lorafleet/... to podman.
# Loaded into the nodes that run the chart's pods (the workers when there are any).
images=("docker.io/lorafleet/operator:$IMAGE_TAG" "docker.io/lorafleet/worker:$IMAGE_TAG-dev" "$MINIO_IMAGE")
chart_nodes=("${workers[@]}"); [ ${#workers[@]} -gt 0 ] || chart_nodes=("$CLUSTER-control-plane")
log "loading ${images[*]} into ${chart_nodes[*]}"
[ "$engine" = docker ] || for i in 0 1; do "$engine" tag "${images[$i]/#docker.io/localhost}" "${images[$i]}"; done
load_images "${chart_nodes[@]}"
[ "$engine" = docker ] || for i in 0 1; do "$engine" untag "${images[$i]}" "${images[$i]}"; done

# -- the tests ------------------------------------------------------------------------------------------------------
# Test servers the pods must reach (the Hub stand-in) listen on the kind network's gateway.
gateway="$(in_ns "$engine" network inspect kind --format '{{range .Subnets}}{{.Gateway}} {{end}}' |
  tr ' ' '\n' | grep -F . | head -1)"
log "pytest (test servers for pods on $gateway)"
rc=0
policy=unenforced; [ "$CNI" = ptp ] || policy=enforced
in_ns env LORAFLEET_E2E_CLUSTER=kubeconfig KUBECONFIG="$STATE/kubeconfig" LORAFLEET_E2E_HOST_ADDRESS="$gateway" \
  LORAFLEET_E2E_MINIO_IMAGE="$MINIO_IMAGE" IMAGE_TAG="$IMAGE_TAG" LORAFLEET_E2E_KIND_ENGINE="$engine" \
  LORAFLEET_E2E_KIND_WORKERS="${workers[*]}" LORAFLEET_E2E_KIND_CNI="$CNI" LORAFLEET_E2E_NETWORK_POLICY="$policy" \
  "$PY" -m pytest "${tests[@]}" || rc=$?
if [ "$rc" -ne 0 ]; then   # CI keeps a log's tail: the cluster as the failure left it, last
  log "pytest failed (exit $rc); the node and every pod now:"
  kubectl_ get nodes,pods --all-namespaces -o wide >&2 || true
  kubectl_ get events --all-namespaces --field-selector type=Warning --sort-by .lastTimestamp 2>/dev/null |
    tail -15 >&2 || true
fi
log "done in $((SECONDS - started))s (pytest exit $rc)"
exit "$rc"
