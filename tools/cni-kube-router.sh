#!/usr/bin/env bash
# The multi-node kind cluster's network plugin (`make e2e-kind-multinode`): kube-router, built from its Go
# module, as a DaemonSet. It gives each node's pods the node's podCIDR (a CNI bridge), routes the other
# nodes' podCIDRs to them (iBGP between the nodes, no overlay: they share the kind network) and enforces
# NetworkPolicy (iptables + ipset). kube-proxy keeps the Services (--run-service-proxy=false).
#
#   tools/cni-kube-router.sh image            # build the image if missing; its name on the last line
#   tools/cni-kube-router.sh manifest IMAGE   # the objects to apply (RBAC, CNI config, DaemonSet)
#
# The image is a Debian bookworm minbase with iptables, ipset and iproute2, plus kube-router and the CNI
# bridge plugin (the node image carries host-local and loopback); its tag is the kube-router version and
# a hash of this script and the pins, so it is built once per change (about a minute) and kept.
# Needs: podman, mmdebstrap, and `tools/build-go-tools.sh kind-cni` (run here when the binaries are missing).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=go-tools.versions
source "$here/go-tools.versions"
# shellcheck source=kind-cni.versions
source "$here/kind-cni.versions"
CACHE="${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}"
BIN="$CACHE/bin"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$CACHE/podman/containers.conf}"
log() { printf '==> [cni-kube-router] %s\n' "$*" >&2; }
hash="$(cat "${BASH_SOURCE[0]}" "$here/kind-cni.versions" "$here/go-tools.versions" | sha256sum | cut -c1-12)"
IMAGE="localhost/lorafleet/kube-router:$KUBE_ROUTER_VERSION-$hash"

build_image() {
  if podman image exists "$IMAGE"; then log "up to date: $IMAGE"; echo "$IMAGE"; return; fi
  "$here/build-go-tools.sh" kind-cni >&2
  command -v mmdebstrap >/dev/null || { log "mmdebstrap is missing (apt-get install mmdebstrap)"; exit 1; }
  local work sources=/etc/apt/sources.list.d/debian.sources
  [ -s "$sources" ] || sources=/etc/apt/sources.list
  work="$(mktemp -d "${TMPDIR:-/tmp}/lorafleet-kube-router.XXXXXX")"
  trap 'rm -rf "$work"' RETURN
  log "building $IMAGE (Debian minbase + iptables, ipset, iproute2)"
  mmdebstrap --quiet --variant=minbase --include=iptables,ipset,iproute2 \
    --customize-hook="install -D -m 0755 '$BIN/kube-router-$KUBE_ROUTER_VERSION/kube-router' \"\$1/usr/local/bin/kube-router\"" \
    --customize-hook="install -D -m 0755 '$BIN/cni-bridge-$CNI_PLUGINS_VERSION/bridge' \"\$1/usr/libexec/cni/bridge\"" \
    bookworm "$work/rootfs.tar" "$sources"
  podman import -q --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENTRYPOINT ["/usr/local/bin/kube-router"]' "$work/rootfs.tar" "$IMAGE" >/dev/null
  # One image is kept: those of earlier inputs go.
  podman images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/lorafleet/kube-router:' | grep -vxF "$IMAGE" |
    xargs -r podman rmi >/dev/null 2>&1 || true
  log "built $IMAGE"
  echo "$IMAGE"
}

manifest() {  # the objects of kube-router's kubeadm example, for an image that is side-loaded (never pulled)
  local image="$1"
  cat <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: kube-router, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: kube-router}
rules:
  - apiGroups: [""]
    resources: [namespaces, pods, services, nodes, endpoints]
    verbs: [list, get, watch]
  - apiGroups: [networking.k8s.io]
    resources: [networkpolicies]
    verbs: [list, get, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [list, get, watch]
  - apiGroups: [coordination.k8s.io]
    resources: [leases]
    verbs: [get, create, update]
  - apiGroups: [""]
    resources: [services/status]
    verbs: [update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: kube-router}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: kube-router}
subjects: [{kind: ServiceAccount, name: kube-router, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: kube-router-cfg, namespace: kube-system}
data:
  # kube-router writes the node's podCIDR into the ipam section.
  cni-conf.json: |
    {"cniVersion": "0.3.0", "name": "kube-router",
     "plugins": [{"name": "kubernetes", "type": "bridge", "bridge": "kube-bridge", "isDefaultGateway": true,
                  "ipam": {"type": "host-local"}}]}
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: kube-router
  namespace: kube-system
  labels: {k8s-app: kube-router}
spec:
  selector:
    matchLabels: {k8s-app: kube-router}
  template:
    metadata:
      labels: {k8s-app: kube-router}
    spec:
      priorityClassName: system-node-critical
      serviceAccountName: kube-router
      hostNetwork: true
      tolerations: [{operator: Exists}]
      initContainers:
        - name: install-cni
          image: $image
          imagePullPolicy: Never
          command: [/bin/sh, -ec]
          args:
            - |
              install -m 0755 /usr/libexec/cni/bridge /opt/cni/bin/bridge
              [ -f /etc/cni/net.d/10-kuberouter.conflist ] ||
                { cp /etc/kube-router/cni-conf.json /etc/cni/net.d/.kuberouter.tmp &&
                  mv /etc/cni/net.d/.kuberouter.tmp /etc/cni/net.d/10-kuberouter.conflist; }
          volumeMounts:
            - {name: cni-conf-dir, mountPath: /etc/cni/net.d}
            - {name: cni-bin-dir, mountPath: /opt/cni/bin}
            - {name: kube-router-cfg, mountPath: /etc/kube-router}
      containers:
        - name: kube-router
          image: $image
          imagePullPolicy: Never
          args:
            - --run-router=true
            - --run-firewall=true
            - --run-service-proxy=false
            - --enable-overlay=false
            - --enable-ipv4=true
            - --enable-ipv6=false
            - --bgp-graceful-restart=true
            # kube-router 2.1 peers with a node on its add or delete only, and with every node at this sync
            # (5 min by default): a node container started again by podman may come back on a new address,
            # and until the next sync no route leads to its pods (make soak-kind's node-loss fault)
            - --routes-sync-period=15s
          env:
            - name: NODE_NAME
              valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
            - name: POD_NAME
              valueFrom: {fieldRef: {fieldPath: metadata.name}}
            - {name: KUBE_ROUTER_CNI_CONF_FILE, value: /etc/cni/net.d/10-kuberouter.conflist}
          livenessProbe:
            httpGet: {path: /healthz, port: 20244}
            initialDelaySeconds: 10
            periodSeconds: 3
          resources:
            requests: {cpu: 50m, memory: 64Mi}
          securityContext: {privileged: true}
          volumeMounts:
            - {name: cni-conf-dir, mountPath: /etc/cni/net.d}
            - {name: xtables-lock, mountPath: /run/xtables.lock}
      volumes:
        - {name: cni-conf-dir, hostPath: {path: /etc/cni/net.d}}
        - {name: cni-bin-dir, hostPath: {path: /opt/cni/bin}}
        - {name: kube-router-cfg, configMap: {name: kube-router-cfg}}
        - {name: xtables-lock, hostPath: {path: /run/xtables.lock, type: FileOrCreate}}
EOF
}

case "${1:-}" in
  image) build_image ;;
  manifest) [ -n "${2:-}" ] || { log "usage: $0 manifest IMAGE"; exit 2; }; manifest "$2" ;;
  *) log "usage: $0 image | manifest IMAGE"; exit 2 ;;
esac
