#!/usr/bin/env bash
# `make images`: build the lorafleet images with docker when its engine answers, else with podman.
#
#   tools/images.sh [IMAGE...]      # IMAGE: operator, worker, worker-dev (default: all three)
#
# Tags: lorafleet/operator:$IMAGE_TAG, lorafleet/worker:$IMAGE_TAG, lorafleet/worker:$IMAGE_TAG-dev
# (IMAGE_TAG defaults to "dev"). The official PYTHON_IMAGE base is used when it can be pulled;
# otherwise a stand-in built from Debian bookworm packages (tools/python-base.sh) under a local name.
# The host's package configuration goes in as build secrets/args (pip.conf, its CA bundle, PIP_*/UV_*
# index settings); with podman the host's uv cache ($LORAFLEET_CACHE/uv) is the build's wheel cache.
set -euo pipefail
cd "$(dirname "$0")/.."
LORAFLEET_CACHE=${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}
IMAGE_TAG=${IMAGE_TAG:-dev}
PYTHON_IMAGE=${PYTHON_IMAGE:-$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile.worker)}
STANDIN=localhost/lorafleet/python-standin:3.11-bookworm
images=("$@"); [ ${#images[@]} -gt 0 ] || images=(operator worker worker-dev)

# -- the engine ---------------------------------------------------------------------------------------
engine=$(tools/container-engine.sh)
[ "$engine" = podman ] && export CONTAINERS_CONF=${CONTAINERS_CONF:-$LORAFLEET_CACHE/podman/containers.conf}
echo "==> building with $engine: ${images[*]} (tag $IMAGE_TAG)"

# -- the base -----------------------------------------------------------------------------------------
if "$engine" image inspect "$PYTHON_IMAGE" >/dev/null 2>&1 || timeout 120 "$engine" pull -q "$PYTHON_IMAGE" >/dev/null 2>&1; then
  base=$PYTHON_IMAGE
else
  base=$STANDIN
  echo "==> $PYTHON_IMAGE cannot be pulled; using the local stand-in $base"
  "$engine" image inspect "$base" >/dev/null 2>&1 || tools/python-base.sh "$engine" "$base"
fi

# -- the host's package configuration -----------------------------------------------------------------
secrets=()
[ -s /etc/pip.conf ] && secrets+=(--secret id=pip.conf,src=/etc/pip.conf)
for ca in "${PIP_CERT:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
  if [ -n "$ca" ] && [ -s "$ca" ]; then secrets+=(--secret "id=ca-bundle,src=$ca"); break; fi
done
build_args=(--build-arg "PYTHON_IMAGE=$base")
for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST UV_DEFAULT_INDEX UV_INDEX UV_INDEX_URL UV_EXTRA_INDEX_URL; do
  [ -n "${!var:-}" ] && build_args+=(--build-arg "$var")   # value taken from the environment, not the command line
done
if [ -z "${UV_DEFAULT_INDEX:-}${UV_INDEX_URL:-}${PIP_INDEX_URL:-}" ] && command -v pip3 >/dev/null; then
  index=$(pip3 config get global.index-url 2>/dev/null || true)
  [ -n "$index" ] && export UV_DEFAULT_INDEX=$index && build_args+=(--build-arg UV_DEFAULT_INDEX)
fi
engine_args=(--network host)
if [ "$engine" = podman ]; then
  mkdir -p "${UV_CACHE_DIR:-$LORAFLEET_CACHE/uv}"
  engine_args+=(--layers -v "${UV_CACHE_DIR:-$LORAFLEET_CACHE/uv}:/var/cache/lorafleet-uv" --build-arg UV_CACHE_DIR=/var/cache/lorafleet-uv)
else
  export DOCKER_BUILDKIT=1
fi

# -- disk -----------------------------------------------------------------------------------------------
# A worker build needs ~7 GB and `make e2e-kind` twice that again (the image archive, the node's unpacked
# copy). Below MIN_FREE_GB free, untagged images (earlier builds, their build-stage layers) are pruned first.
min_free=${MIN_FREE_GB:-30}
store=$(tools/image-store.sh "$engine")
free_gb() { df -P -BG "$store" 2>/dev/null | awk 'NR == 2 {print int($4)}'; }
if [ -n "$(free_gb)" ] && [ "$(free_gb)" -lt "$min_free" ]; then
  echo "==> $(free_gb) GB free for images in $store (under $min_free): pruning untagged images"
  "$engine" image prune -f >/dev/null || true
  echo "==> $(free_gb) GB free now"
fi

# -- build ----------------------------------------------------------------------------------------------
for image in "${images[@]}"; do
  case $image in
    operator) file=Dockerfile.operator tag=lorafleet/operator:$IMAGE_TAG extra=() ;;
    worker) file=Dockerfile.worker tag=lorafleet/worker:$IMAGE_TAG extra=() ;;
    worker-dev) file=Dockerfile.worker tag=lorafleet/worker:$IMAGE_TAG-dev extra=(--build-arg WORKER_EXTRAS=dev) ;;
    *) echo "unknown image $image (operator, worker, worker-dev)" >&2; exit 2 ;;
  esac
  start=$(date +%s)
  echo "==> $tag ($file)"
  before=$("$engine" image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
  "$engine" build "${engine_args[@]}" "${build_args[@]}" "${secrets[@]}" "${extra[@]}" -f "$file" -t "$tag" .
  echo "==> $tag built in $(( $(date +%s) - start )) s"
  # The image the tag named before is untagged now: a worker image is ~6 GB, and every rebuild after a code
  # change left one behind until the disk filled. Removed unless a container or another tag still uses it.
  after=$("$engine" image inspect --format '{{.Id}}' "$tag")
  if [ -n "$before" ] && [ "$before" != "$after" ] && "$engine" rmi "$before" >/dev/null 2>&1; then
    echo "==> removed the previous $tag (${before:0:12})"
  fi
done
