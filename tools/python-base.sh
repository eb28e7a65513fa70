#!/usr/bin/env bash
# Build a stand-in for the official `python:3.11-slim-bookworm` base image from Debian bookworm packages
# (mmdebstrap), for machines that can reach a Debian mirror but no container registry. The rootfs gets the
# host's apt sources and apt settings (so `apt-get install` in a build uses the same mirror) and Debian's
# Python 3.11 with `python`, `pip` and `venv`, as the official image has them.
#
#   tools/python-base.sh ENGINE IMAGE_NAME      # ENGINE: podman or docker
set -euo pipefail
engine=$1 name=$2
command -v mmdebstrap >/dev/null || { echo "mmdebstrap is needed to build the stand-in base (apt-get install mmdebstrap)" >&2; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
sources=()
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
  [ -s "$f" ] && sources+=("$f")
done
[ ${#sources[@]} -gt 0 ] || { echo "no apt sources found on this host" >&2; exit 1; }
aptopts=()
for f in /etc/apt/apt.conf.d/*; do
  grep -qE '^Acquire::(Check-|https?::|Retries|Languages)' "$f" 2>/dev/null && aptopts+=(--aptopt="$f")   # mirror settings, not the host's hooks
done
echo "==> building the stand-in base $name with mmdebstrap (Debian bookworm, python3.11)"
mmdebstrap --variant=minbase --quiet "${aptopts[@]}" \
  --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
  bookworm "$work/rootfs.tar" "${sources[@]}"
"$engine" import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' "$work/rootfs.tar" "$name" >/dev/null
echo "==> stand-in base ready: $name"
