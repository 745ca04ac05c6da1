#!/usr/bin/env bash
# Builds kvfleet's images from docker/, tagged with the version in pyproject.toml (the chart's appVersion):
#   kvfleet/operator:<v>  kvfleet/gateway:<v>  kvfleet/engine:<v>-cpu  [kvfleet/engine:<v>-cuda]
#
#   scripts/build-images.sh                 # operator, gateway, engine-cpu
#   scripts/build-images.sh engine-cuda     # only the named ones
#
# DOCKER picks the client (docker, podman); REGISTRY prefixes the names (e.g. ghcr.io/me/).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
docker_cli="${DOCKER:-docker}"
registry="${REGISTRY:-}"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo_root/pyproject.toml" | head -n 1)"
[[ -n "$version" ]] || { echo "build-images: no version in pyproject.toml" >&2; exit 1; }

image_name() {
    case "$1" in
        operator | gateway) echo "${registry}kvfleet/$1:$version" ;;
        engine-cpu) echo "${registry}kvfleet/engine:$version-cpu" ;;
        engine-cuda) echo "${registry}kvfleet/engine:$version-cuda" ;;
        *) echo "build-images: unknown image '$1' (operator, gateway, engine-cpu, engine-cuda)" >&2; return 1 ;;
    esac
}

if [[ $# -eq 0 ]]; then
    set -- operator gateway engine-cpu
fi
for component in "$@"; do
    name="$(image_name "$component")"
    echo "build-images: $name" >&2
    # build output to stderr: stdout carries only the image names, one a line, for callers to read
    "$docker_cli" build -f "$repo_root/docker/Dockerfile.$component" -t "$name" "$repo_root" >&2
    echo "$name"
done
