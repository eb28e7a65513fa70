#!/usr/bin/env bash
# Print where ENGINE (docker or podman; the caller's CONTAINERS_CONF applies) keeps its images, for a
# free-disk check or log line: podman's graph root, docker's root directory, else /.
#
#   tools/image-store.sh ENGINE
set -uo pipefail
case ${1:-} in
  podman) podman info --format '{{.Store.GraphRoot}}' 2>/dev/null || echo / ;;
  docker) docker info --format '{{.DockerRootDir}}' 2>/dev/null || echo / ;;
  *) echo "usage: tools/image-store.sh docker|podman" >&2; exit 2 ;;
esac
