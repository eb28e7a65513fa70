#!/usr/bin/env bash
# `make kind-node`: a kind node image built here, from Go modules and Debian packages only.
#
# kind's own images (kindest/node, and the registry.k8s.io images kubeadm pulls) come from container
# registries this machine cannot reach, and `kind build node-image` pulls too. This script builds the
# same thing kind's images/base/Dockerfile and `kind build node-image` do, from pinned inputs:
#   - the rootfs: Debian bookworm (systemd 252, which still boots on a cgroup v1 host; kind's trixie
#     base has systemd 257, which does not) with kind's base files (entrypoint, units, containerd config)
#     from the kind module, plus containerd, the CNI plugins, kubelet, kubeadm and kubectl;
#   - the images kubeadm runs, under the names it asks for, FROM scratch (a static binary) or from a
#     minimal Debian (kube-proxy needs iptables): kube-apiserver, kube-controller-manager,
#     kube-scheduler, kube-proxy, etcd, CoreDNS and pause (compiled from the Kubernetes source);
#   - those images are imported into the node's containerd, as kind's builder does, and the result is
#     committed as localhost/lorafleet/kind-node:<k8s version>-<hash of the inputs>.
# kind's default CNI (kindnetd) and storage provisioner are registry images, so the node carries a
# static ptp CNI config instead (one node) and kind falls back to its host-path StorageClass.
#
# Usage: tools/kind-node.sh            # prints the image name on its last line; builds only if missing
#        (KIND_NODE_REBUILD=1: build anyway)
# Needs: podman (CONTAINERS_CONF as tools/container-engine.sh sets up), mmdebstrap, gcc, and the Go tools
# of `tools/build-go-tools.sh kubernetes etcd kind`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=go-tools.versions
source "$here/go-tools.versions"
CACHE="${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}"
BIN="$CACHE/bin"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$CACHE/podman/containers.conf}"
GOMODCACHE="${GOMODCACHE_OVERRIDE:-$CACHE/go/mod}"
KIND_SRC="$GOMODCACHE/sigs.k8s.io/kind@$KIND_VERSION"
K8S_SRC="$GOMODCACHE/k8s.io/kubernetes@$KUBERNETES_VERSION"
log() { printf '==> [kind-node] %s\n' "$*" >&2; }

# -- what kubeadm asks for -------------------------------------------------------------------------------
PAUSE_VERSION=3.10.2   # kubeadm v1.36's PauseVersion
ETCD_TAG="${ETCD_VERSION#v}-0"
COREDNS_TAG="$COREDNS_VERSION"
NODE_PACKAGES=systemd,systemd-sysv,dbus,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,runc,bash,ca-certificates,curl,jq,procps,socat

inputs_hash() {  # what decides the image: this script and the pinned versions (the binaries follow from them)
  cat "${BASH_SOURCE[0]}" "$here/go-tools.versions" | sha256sum | cut -c1-12
}
IMAGE="localhost/lorafleet/kind-node:$KUBERNETES_VERSION-$(inputs_hash)"

# KIND_NODE_REBUILD=1 builds even when the image exists (`make fresh-check` proves the build from nothing).
if [ "${KIND_NODE_REBUILD:-}" != 1 ] && podman image exists "$IMAGE"; then
  log "up to date: $IMAGE"
  echo "$IMAGE"
  exit 0
fi

need() { [ -e "$1" ] || { log "missing $1: run tools/build-go-tools.sh kubernetes etcd kind first"; exit 1; }; }
for f in "$BIN/kubelet-$KUBERNETES_VERSION" "$BIN/kubeadm-$KUBERNETES_VERSION" "$BIN/kube-scheduler-$KUBERNETES_VERSION" \
  "$BIN/kube-proxy-$KUBERNETES_VERSION" "$BIN/kube-apiserver-$KUBERNETES_VERSION" \
  "$BIN/kube-controller-manager-$KUBERNETES_VERSION" "$BIN/kubectl-$KUBERNETES_VERSION" "$BIN/etcd-$ETCD_VERSION" \
  "$BIN/containerd-$CONTAINERD_VERSION" "$BIN/cni-plugins-$CNI_PLUGINS_VERSION" "$BIN/coredns-$COREDNS_VERSION" \
  "$KIND_SRC/images/base/files" "$K8S_SRC/build/pause/linux/pause.c"; do need "$f"; done
command -v mmdebstrap >/dev/null || { log "mmdebstrap is missing (apt-get install mmdebstrap)"; exit 1; }

work="$(mktemp -d "${TMPDIR:-/tmp}/lorafleet-kind-node.XXXXXX")"
builder=""
cleanup() {
  [ -z "$builder" ] || podman rm -f "$builder" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
sources=/etc/apt/sources.list.d/debian.sources
[ -s "$sources" ] || sources=/etc/apt/sources.list

# -- component images --------------------------------------------------------------------------------------
scratch_image() {  # scratch_image NAME:TAG ENTRYPOINT-JSON FILE... : a FROM-scratch image with FILEs in /usr/local/bin
  local name="$1" entrypoint="$2" dir; shift 2
  dir="$(mktemp -d "$work/img.XXXXXX")"
  mkdir -p "$dir/usr/local/bin" "$dir/tmp" "$dir/etc"
  chmod 1777 "$dir/tmp"
  cp "$@" "$dir/usr/local/bin/"
  echo 'nobody:x:65534:65534:nobody:/:/sbin/nologin' >"$dir/etc/passwd"
  tar -C "$dir" --owner=0 --group=0 -c . | podman import -q \
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' --change "ENTRYPOINT $entrypoint" - "$name" >/dev/null
}
log "component images (kubeadm's names)"
k="$BIN"; v="$KUBERNETES_VERSION"
for t in kube-apiserver kube-controller-manager kube-scheduler; do
  cp "$k/$t-$v" "$work/$t"
  scratch_image "registry.k8s.io/$t:$v" "[\"/usr/local/bin/$t\"]" "$work/$t"
done
cp "$k/etcd-$ETCD_VERSION" "$work/etcd"
scratch_image "registry.k8s.io/etcd:$ETCD_TAG" '["/usr/local/bin/etcd"]' "$work/etcd"
cp "$k/coredns-$COREDNS_VERSION/coredns" "$work/coredns"
scratch_image "registry.k8s.io/coredns/coredns:$COREDNS_TAG" '["/usr/local/bin/coredns"]' "$work/coredns"
gcc -Os -static -Wall -Werror -DVERSION="v$PAUSE_VERSION-lorafleet" -o "$work/pause" "$K8S_SRC/build/pause/linux/pause.c"
scratch_image "registry.k8s.io/pause:$PAUSE_VERSION" '["/usr/local/bin/pause"]' "$work/pause"
# kube-proxy runs iptables / conntrack: a minimal Debian with them.
log "kube-proxy image (Debian minbase + iptables, conntrack)"
mmdebstrap --quiet --variant=minbase --include=iptables,conntrack,nftables,kmod \
  --customize-hook="install -m 0755 '$k/kube-proxy-$v' \"\$1/usr/local/bin/kube-proxy\"" \
  bookworm "$work/kube-proxy.tar" "$sources"
podman import -q --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENTRYPOINT ["/usr/local/bin/kube-proxy"]' "$work/kube-proxy.tar" "registry.k8s.io/kube-proxy:$v" >/dev/null
rm -f "$work/kube-proxy.tar"
component_images=("registry.k8s.io/kube-apiserver:$v" "registry.k8s.io/kube-controller-manager:$v"
  "registry.k8s.io/kube-scheduler:$v" "registry.k8s.io/kube-proxy:$v" "registry.k8s.io/etcd:$ETCD_TAG"
  "registry.k8s.io/coredns/coredns:$COREDNS_TAG" "registry.k8s.io/pause:$PAUSE_VERSION")
podman save -q -m --format docker-archive -o "$work/images.tar" "${component_images[@]}"

# -- the node rootfs ----------------------------------------------------------------------------------------
log "node rootfs (Debian bookworm + kind's base files + containerd, CNI plugins, kubelet, kubeadm, kubectl)"
files="$KIND_SRC/images/base/files"
cni="$BIN/cni-plugins-$CNI_PLUGINS_VERSION"
ctrd="$BIN/containerd-$CONTAINERD_VERSION"
cat >"$work/customize.sh" <<EOF
#!/bin/sh
# mmdebstrap customize hook (\$1 = the rootfs): what kind's base Dockerfile and node-image builder do.
set -eu
r="\$1"
mkdir -p "\$r/kind/bin" "\$r/LICENSES" "\$r/etc/containerd" "\$r/etc/default" "\$r/etc/sysctl.d" \
  "\$r/etc/systemd/system/kubelet.service.d" "\$r/opt/cni/bin" "\$r/etc/cni/net.d" "\$r/etc/kubernetes/manifests"
install -m 0755 "$files"/usr/local/bin/* "\$r/usr/local/bin/"
cp -r "$files"/kind/. "\$r/kind/"; chmod -R u+w,go-w "\$r/kind"; chmod 0755 "\$r"/kind/bin/*
install -m 0644 "$files"/etc/crictl.yaml "\$r/etc/"
install -m 0644 "$files"/etc/default/* "\$r/etc/default/"
install -m 0644 "$files"/etc/sysctl.d/* "\$r/etc/sysctl.d/"
install -m 0644 "$files"/etc/systemd/system/*.service "$files"/etc/systemd/system/*.slice "\$r/etc/systemd/system/"
install -m 0644 "$files"/etc/systemd/system/kubelet.service.d/* "\$r/etc/systemd/system/kubelet.service.d/"
# kubeadm's pause tag; and containerd must not ask for a lower oom_score_adj than its own: runc's
# "failed to update /proc/self/oom_score_adj: Permission denied" killed every sandbox here otherwise.
sed -e 's#registry.k8s.io/pause:[0-9.]*#registry.k8s.io/pause:$PAUSE_VERSION#' \
  -e 's#restrict_oom_score_adj = false#restrict_oom_score_adj = true#' "$files"/etc/containerd/config.toml \
  >"\$r/etc/containerd/config.toml"
install -m 0755 "$ctrd"/containerd "$ctrd"/containerd-shim-runc-v2 "$ctrd"/ctr "\$r/usr/local/bin/"
install -m 0755 "$cni"/ptp "$cni"/loopback "$cni"/host-local "$cni"/portmap "\$r/opt/cni/bin/"
for t in kubelet kubeadm kubectl; do install -m 0755 "$k/\$t-$v" "\$r/usr/bin/\$t"; done
install -m 0644 "$work/cri-base.json" "\$r/etc/containerd/cri-base.json"
install -m 0644 "$work/10-lorafleet-ptp.conflist" "\$r/etc/cni/net.d/"
echo "$v" >"\$r/kind/version"
# as kind's base Dockerfile: only the units a node needs, no kmsg, /sbin/init
find "\$r/lib/systemd/system/sysinit.target.wants/" -name systemd-tmpfiles-setup.service -delete
rm -f "\$r"/lib/systemd/system/multi-user.target.wants/* "\$r"/etc/systemd/system/*.wants/* \
  "\$r"/lib/systemd/system/local-fs.target.wants/* "\$r"/lib/systemd/system/sockets.target.wants/*udev* \
  "\$r"/lib/systemd/system/sockets.target.wants/*initctl* "\$r"/lib/systemd/system/basic.target.wants/*
echo "ReadKMsg=no" >>"\$r/etc/systemd/journald.conf"
ln -sf /usr/lib/systemd/systemd "\$r/sbin/init"
chroot "\$r" systemctl enable kubelet.service containerd.service undo-mount-hacks.service >/dev/null 2>&1
chroot "\$r" systemctl mask systemd-binfmt.service >/dev/null 2>&1
EOF
chmod +x "$work/customize.sh"
# containerd's default OCI spec, with kind's product-files hook and no rlimits (as kind's Dockerfile).
"$ctrd/ctr" oci spec | python3 -c '
import json, sys
spec = json.load(sys.stdin)
spec.setdefault("hooks", {}).setdefault("createContainer", []).append({"path": "/kind/bin/mount-product-files.sh"})
spec["process"].pop("rlimits", None)
json.dump(spec, sys.stdout, indent=2)' >"$work/cri-base.json"
# One node, so a static ptp network on kind's default pod subnet stands in for kindnetd.
cat >"$work/10-lorafleet-ptp.conflist" <<'EOF'
{
  "cniVersion": "1.0.0",
  "name": "lorafleet-kind",
  "plugins": [
    {"type": "ptp", "ipMasq": true, "mtu": 1500,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
mmdebstrap --quiet --variant=minbase --include="$NODE_PACKAGES" --customize-hook="$work/customize.sh \"\$1\"" \
  bookworm "$work/node.tar" "$sources"
base="localhost/lorafleet/kind-node-base:$(inputs_hash)"
podman import -q "$work/node.tar" "$base" >/dev/null
rm -f "$work/node.tar"

# -- preload the component images into the node's containerd (kind's builder does this too) ---------------
log "importing ${#component_images[@]} images into the node's containerd"
builder="lorafleet-kind-node-build-$$"
podman run -d --name "$builder" --privileged --network none --entrypoint sleep "$base" infinity >/dev/null
podman cp "$work/images.tar" "$builder:/images.tar"
podman exec "$builder" sh -c '
  set -e
  containerd >/var/log/containerd-build.log 2>&1 &
  for i in $(seq 1 100); do ctr version >/dev/null 2>&1 && break; sleep 0.2; done
  ctr --namespace=k8s.io images import --label=io.cri-containerd.pinned=pinned --all-platforms --no-unpack \
    --digests /images.tar >/dev/null
  ctr --namespace=k8s.io images list -q | grep -v -e "^sha256:" -e "^import-" | sort
  pkill containerd; while pgrep -x containerd >/dev/null; do sleep 0.2; done
  rm -rf /images.tar /var/log/containerd-build.log /run/containerd /run/nri'
podman commit -q \
  --change 'ENV container=docker' --change 'STOPSIGNAL SIGRTMIN+3' \
  --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' --change 'CMD []' \
  "$builder" "$IMAGE" >/dev/null
podman rmi -f "$base" "${component_images[@]}" >/dev/null 2>&1 || true
# One node image is kept: the ones of earlier inputs go (about 1 GB each).
podman images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/lorafleet/kind-node:' | grep -vxF "$IMAGE" |
  xargs -r podman rmi >/dev/null 2>&1 || true
log "built $IMAGE"
echo "$IMAGE"
