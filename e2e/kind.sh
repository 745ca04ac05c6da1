#!/usr/bin/env bash
# kvfleet's end-to-end scenarios on a kind cluster: build the images, load them into kind, `helm install` the
# chart, apply the CPU example fleet, then run e2e/ through the gateway (the same scenarios CI runs against the
# local cluster). Needs docker, kind, kubectl, curl and Python with `pip install -e '.[test]'`; helm is fetched if
# missing (scripts/fetch-helm.sh).
#
#   e2e/kind.sh                   # creates the cluster kvfleet-e2e, deletes it at the end
#   KEEP_CLUSTER=1 e2e/kind.sh    # leaves the cluster for a look around (kind delete cluster --name kvfleet-e2e)
#   KVFLEET_E2E_GATEWAY_MODE=python e2e/kind.sh  # gateway.mode=python (default: envoy, the chart's default)
#   KVFLEET_E2E_GATEWAY_MODE=inferencePool e2e/kind.sh
#                                 # gateway.mode=inferencePool: installs the Gateway API and InferencePool CRDs and
#                                 # kgateway with its inference extension (pinned below), applies
#                                 # e2e/inference-gateway.yaml, and runs the scenarios through that Gateway
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cluster="${KIND_CLUSTER:-kvfleet-e2e}"
namespace="${KVFLEET_E2E_NAMESPACE:-kvfleet}"
release="${KVFLEET_E2E_RELEASE:-kvfleet}"
local_port="${KVFLEET_E2E_PORT:-18080}"
gateway_mode="${KVFLEET_E2E_GATEWAY_MODE:-envoy}"
# inferencePool mode: the versions installed (InferencePool v1 from the Inference Extension's v1.1.0, whose guide
# pairs it with kgateway v2.1.0; the Gateway API it builds against, v1.4.0).
gateway_api_version="v1.4.0"
inference_extension_version="v1.1.0"
kgateway_version="v2.1.0"
cd "$repo_root"

case "$gateway_mode" in
    python | envoy | inferencePool) ;;
    *) echo "kind.sh: KVFLEET_E2E_GATEWAY_MODE must be python, envoy or inferencePool, not $gateway_mode" >&2
       exit 1 ;;
esac

for tool in docker kind kubectl curl python; do
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

values=(--values e2e/values-kind.yaml --set "gateway.mode=$gateway_mode")
if [[ "$gateway_mode" == inferencePool ]]; then
    kubectl apply --server-side -f \
        "https://github.com/kubernetes-sigs/gateway-api/releases/download/$gateway_api_version/standard-install.yaml"
    kubectl apply --server-side -f "https://raw.githubusercontent.com/kubernetes-sigs/gateway-api-inference-extension/$inference_extension_version/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
    helm upgrade --install kgateway-crds oci://cr.kgateway.dev/kgateway-dev/charts/kgateway-crds \
        --version "$kgateway_version" --namespace kgateway-system --create-namespace --wait
    helm upgrade --install kgateway oci://cr.kgateway.dev/kgateway-dev/charts/kgateway \
        --version "$kgateway_version" --namespace kgateway-system --set inferenceExtension.enabled=true \
        --wait --timeout 5m
    kubectl apply -f e2e/inference-gateway.yaml
    kubectl wait --namespace gateways --for=condition=Programmed gateway/inference-gateway --timeout=5m
    values+=(--values e2e/values-kind-inference-pool.yaml)
fi

helm install "$release" charts/kvfleet --namespace "$namespace" --create-namespace \
    "${values[@]}" --wait --timeout 10m
kubectl apply --namespace "$namespace" -f charts/kvfleet/examples/inferencefleet-cpu.yaml
kubectl wait --namespace "$namespace" --for=jsonpath='{.status.readyReplicas}'=1 inferencefleet/chat --timeout=10m
helm test "$release" --namespace "$namespace" --timeout 5m

if [[ "$gateway_mode" == inferencePool ]]; then
    # the route must be accepted by the Gateway and its InferencePool backend resolved before requests flow
    route="$(kubectl get httproute --namespace "$namespace" -l "app.kubernetes.io/instance=$release" \
        -o jsonpath='{.items[0].metadata.name}')"
    conditions='{.status.parents[0].conditions[?(@.type=="Accepted")].status} '
    conditions+='{.status.parents[0].conditions[?(@.type=="ResolvedRefs")].status}'
    route_status=""
    for _ in $(seq 1 150); do
        route_status="$(kubectl get httproute --namespace "$namespace" "$route" -o jsonpath="$conditions")"
        [[ "$route_status" == "True True" ]] && break
        sleep 2
    done
    if [[ "$route_status" != "True True" ]]; then
        echo "kind.sh: HTTPRoute $route is not Accepted and ResolvedRefs: $route_status" >&2
        kubectl get httproute --namespace "$namespace" "$route" -o yaml >&2
        exit 1
    fi
    # kgateway names the Gateway's Service after it, in its namespace
    kubectl port-forward --namespace gateways service/inference-gateway "$local_port:80" >/dev/null &
else
    gateway_service="$(kubectl get service --namespace "$namespace" \
        -l "app.kubernetes.io/instance=$release,app.kubernetes.io/component=gateway" \
        -o jsonpath='{.items[0].metadata.name}')"
    kubectl port-forward --namespace "$namespace" "service/$gateway_service" "$local_port:http" >/dev/null &
fi
port_forward_pid=$!
for _ in $(seq 1 60); do
    curl -fsS "http://127.0.0.1:$local_port/ready" >/dev/null 2>&1 && break
    sleep 1
done

KVFLEET_E2E_GATEWAY_URL="http://127.0.0.1:$local_port" KVFLEET_E2E_NAMESPACE="$namespace" \
    KVFLEET_E2E_FLEET=chat KVFLEET_E2E_RELEASE="$release" KVFLEET_E2E_KIND=1 \
    KVFLEET_E2E_GATEWAY_MODE="$gateway_mode" python -m pytest -q e2e
