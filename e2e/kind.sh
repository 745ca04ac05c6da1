#!/usr/bin/env bash
# kvfleet's end-to-end scenarios on a kind cluster: build the images, load them into kind, `helm install` the
# chart, apply the CPU example fleet, then run e2e/ through the gateway (the same scenarios CI runs against the
# local cluster). Needs docker, kind, kubectl and Python with `pip install -e '.[test]'`; helm is fetched if
# missing (scripts/fetch-helm.sh).
#
#   e2e/kind.sh                   # creates the cluster kvfleet-e2e, deletes it at the end
#   KEEP_CLUSTER=1 e2e/kind.sh    # leaves the cluster for a look around (kind delete cluster --name kvfleet-e2e)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cluster="${KIND_CLUSTER:-kvfleet-e2e}"
namespace="${KVFLEET_E2E_NAMESPACE:-kvfleet}"
release="${KVFLEET_E2E_RELEASE:-kvfleet}"
local_port="${KVFLEET_E2E_PORT:-18080}"
cd "$repo_root"

for tool in docker kind kubectl python; do
    command -v "$tool" >/dev/null 2>&1 || { echo "kind.sh: $tool is required" >&2; exit 1; }
done
helm_bin="$(scripts/fetch-helm.sh)"
PATH="$(dirname "$helm_bin"):$PATH"  # the uninstall scenario calls helm
export PATH

port_forward_pid=""
cleanup() {
    [[ -n "$port_forward_pid" ]] && kill "$port_forward_pid" 2>/dev/null || true
    if [[ -z "${KEEP_CLUSTER:-}" ]]; then
        kind delete cluster --name "$cluster"
    fi
}
trap cleanup EXIT

if ! kind get clusters | grep -qx "$cluster"; then
    kind create cluster --name "$cluster" --config e2e/kind-config.yaml --wait 120s
fi
kubectl config use-context "kind-$cluster"

mapfile -t images < <(scripts/build-images.sh operator gateway engine-cpu)
for image in "${images[@]}"; do
    kind load docker-image "$image" --name "$cluster"
done

helm install "$release" charts/kvfleet --namespace "$namespace" --create-namespace \
    --values e2e/values-kind.yaml --wait --timeout 10m
kubectl apply --namespace "$namespace" -f charts/kvfleet/examples/inferencefleet-cpu.yaml
kubectl wait --namespace "$namespace" --for=jsonpath='{.status.readyReplicas}'=1 inferencefleet/chat --timeout=10m
helm test "$release" --namespace "$namespace" --timeout 5m

gateway_service="$(kubectl get service --namespace "$namespace" \
    -l "app.kubernetes.io/instance=$release,app.kubernetes.io/component=gateway" -o jsonpath='{.items[0].metadata.name}')"
kubectl port-forward --namespace "$namespace" "service/$gateway_service" "$local_port:http" >/dev/null &
port_forward_pid=$!
for _ in $(seq 1 60); do
    curl -fsS "http://127.0.0.1:$local_port/ready" >/dev/null 2>&1 && break
    sleep 1
done

KVFLEET_E2E_GATEWAY_URL="http://127.0.0.1:$local_port" KVFLEET_E2E_NAMESPACE="$namespace" \
    KVFLEET_E2E_FLEET=chat KVFLEET_E2E_RELEASE="$release" KVFLEET_E2E_KIND=1 \
    python -m pytest -q e2e
