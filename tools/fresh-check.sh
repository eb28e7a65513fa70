#!/usr/bin/env bash
# `make fresh-check`: the README's two commands as a new user runs them, on a clean clone with an empty
# LORAFLEET_CACHE, so that no cached model, adapter, venv or tool hides a broken setup step.
#
# Reused from this machine (downloads, and Go's content-addressed compile cache, which can only return
# an output for identical inputs): uv's package cache, the Go module cache, and GOCACHE unless
# FRESH_STRICT=1 (then Go compiles everything again too: add ~20 min on 2 cores). Everything else is
# built from nothing: the venv, the Go-built tools, MinIO, the real model, the trained adapters, the kind
# node image.
#
# Usage: tools/fresh-check.sh            clone HEAD (committed work only) into a temporary directory
# Env:   FRESH_DIR=dir (default: a new mktemp dir), FRESH_KEEP=1 keeps it after a success,
#        FRESH_STRICT=1 (see above), FRESH_TARGETS="demo test" (the README's commands, in order).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}"
dir="${FRESH_DIR:-$(mktemp -d /tmp/lorafleet-fresh.XXXXXX)}"
targets="${FRESH_TARGETS:-demo test}"
log() { printf '==> [fresh-check] %s\n' "$*"; }

[ -z "$(git -C "$repo" status --porcelain --untracked-files=no)" ] ||
  log "note: uncommitted changes are not part of the check (it clones HEAD $(git -C "$repo" rev-parse --short HEAD))"
mkdir -p "$dir"
git clone -q --no-local "$repo" "$dir/repo"
mkdir -p "$dir/cache"

export LORAFLEET_CACHE="$dir/cache"
export UV_CACHE_DIR="${UV_CACHE_DIR:-$cache/uv}"
export GOMODCACHE_OVERRIDE="$cache/go/mod" GOMODCACHE="$(go env GOMODCACHE)"
if [ "${FRESH_STRICT:-}" = 1 ]; then
  export GOCACHE_OVERRIDE="$dir/go-build" GOCACHE="$dir/go-build"
else
  export GOCACHE_OVERRIDE="$cache/go/build"
fi
# The kind node image lives in podman's store, not in LORAFLEET_CACHE: build it again all the same.
export KIND_NODE_REBUILD=1
log "clone of $(git -C "$dir/repo" rev-parse --short HEAD) in $dir/repo, empty LORAFLEET_CACHE=$LORAFLEET_CACHE"

summary=()
for target in $targets; do
  out="$dir/make-$target.log"
  log "make $target (log: $out)"
  start=$(date +%s)
  set +e
  (cd "$dir/repo" && make "$target") >"$out" 2>&1
  rc=$?
  set -e
  took=$(($(date +%s) - start))
  summary+=("make $target: exit $rc in $((took / 60)) min $((took % 60)) s")
  if [ "$rc" -ne 0 ]; then
    log "make $target FAILED after ${took} s; last 40 lines of $out:"
    tail -n 40 "$out" >&2
    printf '==> [fresh-check] %s\n' "${summary[@]}"
    log "kept $dir for inspection"
    exit 1
  fi
  grep -E "passed|failed" "$out" | tail -n 1 || true
done
printf '==> [fresh-check] %s\n' "${summary[@]}"
if [ "${FRESH_KEEP:-}" = 1 ]; then log "kept $dir"; else rm -rf "$dir"; log "passed; removed $dir"; fi
