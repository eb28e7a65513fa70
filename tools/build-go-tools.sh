#!/usr/bin/env bash
# Build the pinned Go tools (kube-apiserver, kube-controller-manager, kubectl,
# etcd, helm) from their Go modules into $LORAFLEET_CACHE/bin/<tool>-<version>.
# The `kind` target builds what a kind node needs instead: kind itself,
# kubelet / kubeadm / kube-scheduler / kube-proxy, containerd, the CNI plugins and
# CoreDNS; multi-binary modules land in a directory $BIN/<name>-<version>/.
#
# Each tool gets a throwaway wrapper module generated under
# $LORAFLEET_CACHE/go-wrappers/ (replace directives only work in the main
# module). A tool whose versioned binary exists is not rebuilt, so a second run
# builds nothing. Wall times of each build are appended to
# $LORAFLEET_CACHE/go-build-times.log.
#
# Tools already on this machine at exactly the pinned version are used instead of
# building (linked into $LORAFLEET_CACHE/bin, and named in the output): kubectl and
# helm on PATH, etcd / kube-apiserver / kubectl in $KUBEBUILDER_ASSETS (as
# `setup-envtest use -p path` leaves them). A failed step prints the last 50 lines
# of its log and the log's path.
#
# The `kind-cni` target (not a default, not part of setup) builds the multi-node kind cluster's network
# (kube-router and the CNI bridge plugin; pins in kind-cni.versions).
#
# Usage: tools/build-go-tools.sh [kubernetes|etcd|helm|kind|kind-cni ...]   (default: kubernetes etcd helm)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=go-tools.versions
source "$here/go-tools.versions"

CACHE="${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}"
BIN="$CACHE/bin"
WRAPPERS="$CACHE/go-wrappers"
TIMES="$CACHE/go-build-times.log"
JOBS="${GO_BUILD_JOBS:-2}"
mkdir -p "$BIN" "$WRAPPERS"

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false
# Module and build caches live in the lorafleet cache so CI can keep them.
export GOMODCACHE="${GOMODCACHE_OVERRIDE:-$CACHE/go/mod}"
export GOCACHE="${GOCACHE_OVERRIDE:-$CACHE/go/build}"

DEFAULT_TAGS=selinux,notest,grpcnotrace
BUILD_TAGS="$DEFAULT_TAGS"

log() { printf '==> [go-tools] %s\n' "$*"; }

# sum.golang.org is often unreachable directly; the Go proxy relays the
# checksum database (proxy.golang.org/sumdb/...), which `go` uses on its own.
# Only if neither works, fall back to GOSUMDB=off (less safe; say so loudly).
SUMDB_CHECKED=
check_sumdb() {  # called before the first download only, so a warm run stays offline
  if [ -n "$SUMDB_CHECKED" ] || [ -n "${GOSUMDB:-}" ]; then return; fi
  SUMDB_CHECKED=1
  if go mod download -json golang.org/x/text@v0.3.8 >/dev/null 2>&1; then return; fi
  log "WARNING: checksum database unreachable (directly and via the proxy): GOSUMDB=off"
  export GOSUMDB=off
}

# Print a progress line every 100 packages compiled (`go build -v` output).
progress() {
  awk -v tool="$1" '{ n++; if (n % 100 == 0) { printf "==> [go-tools] %s: %d packages compiled (%s)\n", tool, n, $0; fflush() } }
    END { printf "==> [go-tools] %s: %d packages compiled\n", tool, n }'
}

new_wrapper() {  # new_wrapper NAME -> prints the directory of a fresh wrapper module
  local dir="$WRAPPERS/$1"
  rm -rf "$dir" && mkdir -p "$dir"
  (cd "$dir" && go mod init "lorafleet.local/tools/$1" >/dev/null 2>&1 && go mod edit -go=1.26)
  echo "$dir"
}

failed() {  # failed LOGFILE WHAT : the last 50 lines of the log and its path, then exit 1
  echo "==> [go-tools] $2 FAILED; last 50 lines of $1:" >&2
  tail -n 50 "$1" >&2
  echo "==> [go-tools] full log: $1" >&2
  exit 1
}

go_build() {  # go_build TOOL-LABEL WRAPPER-DIR OUTDIR LDFLAGS PKG...  (full output in WRAPPER-DIR/build.log)
  local label="$1" dir="$2" out="$3" ldflags="$4"; shift 4
  (cd "$dir" && nice -n 10 go build -p "$JOBS" -v -trimpath -tags="$BUILD_TAGS" \
      -ldflags "-s -w $ldflags" -o "$out/" "$@" 2>&1 | tee build.log | progress "$label"; exit "${PIPESTATUS[0]}") ||
    failed "$dir/build.log" "$label build"
}

# adopt TOOL VERSION CANDIDATE... : link the first candidate that reports exactly VERSION as $BIN/TOOL-VERSION.
adopt() {
  local tool="$1" version="$2" c found; shift 2
  have "$tool-$version" && return 0
  for c in "$@"; do
    [ -n "$c" ] && [ -x "$c" ] || continue
    found=$(tool_version "$tool" "$c" 2>/dev/null || true)
    if [ "$found" = "$version" ]; then
      ln -sf "$(readlink -f "$c")" "$BIN/$tool-$version"
      log "$tool $version: using $c (already on this machine) instead of building"
      return 0
    fi
    [ -z "$found" ] || log "$tool: $c is ${found}, not $version: not used"
  done
  return 0
}

tool_version() {  # tool_version TOOL PATH -> the version it reports, as pinned (vX.Y.Z)
  case "$1" in
    kubectl) "$2" version --client -o json | sed -n 's/.*"gitVersion": "\(v[^"]*\)".*/\1/p' | head -1 ;;
    kube-apiserver|kube-controller-manager) "$2" --version | awk '{print $2}' ;;
    etcd) "$2" --version | sed -n 's/^etcd Version: \(.*\)/v\1/p' ;;
    helm) "$2" version --template '{{.Version}}' ;;
  esac
}

adopt_existing() {
  local assets="${KUBEBUILDER_ASSETS:-}"
  adopt kubectl "$KUBERNETES_VERSION" "$(command -v kubectl || true)" "${assets:+$assets/kubectl}"
  adopt kube-apiserver "$KUBERNETES_VERSION" "${assets:+$assets/kube-apiserver}" "$(command -v kube-apiserver || true)"
  adopt kube-controller-manager "$KUBERNETES_VERSION" "$(command -v kube-controller-manager || true)"
  adopt etcd "$ETCD_VERSION" "${assets:+$assets/etcd}" "$(command -v etcd || true)"
  adopt helm "$HELM_VERSION" "$(command -v helm || true)"
}

BUILT=
timed() {  # timed LABEL CMD... : run; if it built something, report and record the wall time
  local label="$1"; shift
  local start=$SECONDS
  BUILT=
  "$@"
  [ -n "$BUILT" ] || return 0
  local took=$((SECONDS - start))
  log "$label built in ${took}s"
  printf '%s %s %ss\n' "$(date -u +%FT%TZ)" "$label" "$took" >>"$TIMES"
}

quiet() {  # quiet LOGFILE CMD... : run CMD with output to LOGFILE; on failure its last 50 lines and path
  local out="$1"; shift
  "$@" >"$out" 2>&1 || failed "$PWD/$out" "$*"
}

have() { [ -x "$BIN/$1" ]; }

build_kubernetes() {  # build_kubernetes WRAPPER-NAME TOOL... : the tools (k8s.io/kubernetes/cmd/TOOL) not built yet
  local v="$KUBERNETES_VERSION" staging="${KUBERNETES_VERSION/#v1./v0.}" wrapper="$1"; shift
  local missing=() t
  for t in "$@"; do have "$t-$v" || missing+=("$t"); done
  if [ ${#missing[@]} -eq 0 ]; then log "kubernetes $v ($*): up to date"; return; fi
  log "kubernetes $v: building ${missing[*]} (cold: downloads ~1 GB of modules, tens of minutes)"
  check_sumdb
  local dir; dir="$(new_wrapper "$wrapper")"
  local info gomod commit
  info="$(cd "$dir" && go mod download -json "k8s.io/kubernetes@$v" 2>&1)" || {
    echo "$info" >"$dir/download.log"; failed "$dir/download.log" "go mod download k8s.io/kubernetes@$v"; }
  gomod="$(sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p' <<<"$info")"
  commit="$(sed -n 's/^\s*"Hash": "\(.*\)",\?$/\1/p' <<<"$info" | head -1)"
  # Every staging module (replaced by ./staging/src/... upstream) -> its v0.x.y release.
  local edits=() m
  while read -r m; do edits+=("-replace=$m=$m@$staging"); done < <(
    awk '$2 == "=>" && $3 ~ /^\.\/staging\/src\// { print $1 }' "$gomod")
  [ ${#edits[@]} -gt 20 ] || { log "found only ${#edits[@]} staging modules in $gomod"; exit 1; }
  while read -r m; do edits+=("-godebug=$m"); done < <(awk '$1 == "godebug" && NF == 2 { print $2 }' "$gomod")
  (cd "$dir" && go mod edit "${edits[@]}" -require="k8s.io/kubernetes@$v")
  log "kubernetes $v: ${#edits[@]} go.mod edits; resolving modules"
  log "kubernetes $v: downloading modules (log: $dir/get.log)"
  (cd "$dir" && for t in "${missing[@]}"; do quiet get.log go get -tool "k8s.io/kubernetes/cmd/$t@$v"; done)
  local ld="" p
  local major="${v#v}"; major="${major%%.*}"
  local minor="${v#v*.}"; minor="${minor%%.*}"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $p.gitVersion=$v -X $p.gitMajor=$major -X $p.gitMinor=$minor"
    ld+=" -X $p.gitTreeState=clean -X $p.gitCommit=$commit -X $p.buildDate=$(date -u +%FT%TZ)"
  done
  local out="$dir/out" pkgs=()
  for t in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$t"); done
  go_build "kubernetes $v" "$dir" "$out" "$ld" "${pkgs[@]}"
  for t in "${missing[@]}"; do mv "$out/$t" "$BIN/$t-$v"; done
  BUILT=1
}

build_etcd() {
  local v="$ETCD_VERSION"
  if have "etcd-$v"; then log "etcd $v: up to date"; return; fi
  log "etcd $v: building"
  check_sumdb
  local dir; dir="$(new_wrapper "etcd-$v")"
  (cd "$dir" && quiet get.log go get -tool "go.etcd.io/etcd/server/v3@$v")
  go_build "etcd $v" "$dir" "$dir/out" "" go.etcd.io/etcd/server/v3
  mv "$dir/out/server" "$BIN/etcd-$v"
  BUILT=1
}

build_helm() {
  local v="$HELM_VERSION" k="${KUBERNETES_VERSION#v}"
  if have "helm-$v"; then log "helm $v: up to date"; return; fi
  log "helm $v: building"
  check_sumdb
  local dir; dir="$(new_wrapper "helm-$v")"
  (cd "$dir" && quiet get.log go get -tool "helm.sh/helm/v3/cmd/helm@$v")
  local ld="-X helm.sh/helm/v3/internal/version.version=$v" p
  # Default Kubernetes version for `helm template` / `lint` (else v1.20).
  for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ld+=" -X $p.k8sVersionMajor=${k%%.*} -X $p.k8sVersionMinor=$(cut -d. -f2 <<<"$k")"
  done
  go_build "helm $v" "$dir" "$dir/out" "$ld" helm.sh/helm/v3/cmd/helm
  mv "$dir/out/helm" "$BIN/helm-$v"
  BUILT=1
}

build_module() {  # build_module NAME VERSION LDFLAGS PKG... : PKG@VERSION binaries into the directory $BIN/NAME-VERSION/
  local name="$1" v="$2" ld="$3"; shift 3
  if [ -d "$BIN/$name-$v" ]; then log "$name $v: up to date"; return; fi
  log "$name $v: building $*"
  check_sumdb
  local dir p; dir="$(new_wrapper "$name-$v")"
  (cd "$dir" && for p in "$@"; do quiet get.log go get -tool "$p@$v"; done)
  go_build "$name $v" "$dir" "$dir/out" "$ld" "$@"
  mv "$dir/out" "$BIN/$name-$v"
  BUILT=1
}

build_kind_tools() {  # everything a locally built kind node image needs (tools/kind-node.sh assembles it)
  timed "kubernetes-node-$KUBERNETES_VERSION" build_kubernetes "kubernetes-node-$KUBERNETES_VERSION" \
    kubelet kubeadm kube-scheduler kube-proxy
  timed "kind-$KIND_VERSION" build_module kind "$KIND_VERSION" "" sigs.k8s.io/kind
  local c=github.com/containerd/containerd/v2
  BUILD_TAGS="$DEFAULT_TAGS,no_aufs,no_zfs,no_btrfs,no_devmapper"
  timed "containerd-$CONTAINERD_VERSION" build_module containerd "$CONTAINERD_VERSION" \
    "-X $c/version.Version=$CONTAINERD_VERSION -X $c/version.Package=$c" \
    "$c/cmd/containerd" "$c/cmd/containerd-shim-runc-v2" "$c/cmd/ctr"
  BUILD_TAGS="$DEFAULT_TAGS"
  local cni=github.com/containernetworking/plugins/plugins
  timed "cni-plugins-$CNI_PLUGINS_VERSION" build_module cni-plugins "$CNI_PLUGINS_VERSION" "" \
    "$cni/main/ptp" "$cni/main/loopback" "$cni/ipam/host-local" "$cni/meta/portmap"
  timed "coredns-$COREDNS_VERSION" build_module coredns "$COREDNS_VERSION" \
    "-X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" github.com/coredns/coredns
}

build_kind_cni() {  # the multi-node kind network: kube-router (routes + NetworkPolicy) and the bridge plugin it drives
  # shellcheck source=kind-cni.versions
  source "$here/kind-cni.versions"
  local r=github.com/cloudnativelabs/kube-router/v2
  timed "kube-router-$KUBE_ROUTER_VERSION" build_module kube-router "$KUBE_ROUTER_VERSION" \
    "-X $r/pkg/version.Version=$KUBE_ROUTER_VERSION" "$r/cmd/kube-router"
  timed "cni-bridge-$CNI_PLUGINS_VERSION" build_module cni-bridge "$CNI_PLUGINS_VERSION" "" \
    github.com/containernetworking/plugins/plugins/main/bridge
}

main() {
  local targets=("$@")
  [ ${#targets[@]} -gt 0 ] || targets=(etcd helm kubernetes)
  adopt_existing
  local t
  for t in "${targets[@]}"; do
    case "$t" in
      kubernetes) timed "kubernetes-$KUBERNETES_VERSION" build_kubernetes "kubernetes-$KUBERNETES_VERSION" \
        kube-apiserver kube-controller-manager kubectl ;;
      etcd) timed "etcd-$ETCD_VERSION" build_etcd ;;
      helm) timed "helm-$HELM_VERSION" build_helm ;;
      kind) build_kind_tools ;;
      kind-cni) build_kind_cni ;;
      *) log "unknown tool: $t (kubernetes, etcd, helm, kind, kind-cni)"; exit 2 ;;
    esac
  done
  log "all Go tools ready in $BIN"
}

main "$@"
