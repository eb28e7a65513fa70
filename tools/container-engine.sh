#!/usr/bin/env bash
# Print the container engine to use: docker when its engine answers, else podman (installed with apt
# when missing and possible, and configured for this kind of host). Exits 1 with what to install otherwise.
set -euo pipefail
LORAFLEET_CACHE=${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker; exit 0; fi
if ! command -v podman >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> no docker engine and no podman: installing podman, runc, mmdebstrap with apt-get" >&2
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc mmdebstrap; } >&2
  else
    echo "No container engine: install Docker (with a running engine) or podman + runc" \
         "(Debian/Ubuntu: sudo apt-get install podman runc mmdebstrap)." >&2
    exit 1
  fi
fi
# podman with runc, cgroupfs and no default ulimits (crun and the defaults fail on hybrid-cgroup hosts).
conf=$LORAFLEET_CACHE/podman/containers.conf
if [ ! -s "$conf" ]; then
  mkdir -p "$(dirname "$conf")"
  printf '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n' > "$conf"
fi
echo podman
