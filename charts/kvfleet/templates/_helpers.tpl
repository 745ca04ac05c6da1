{{/* Names: <release>-kvfleet, or <release> when the release name already says kvfleet. */}}
{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A component's object name: <fullname>-<component>. Call with (list $ "gateway"). */}}
{{- define "kvfleet.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "kvfleet.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{- define "kvfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: kvfleet
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of a component; never change them on upgrade (Deployment selectors are immutable). */}}
{{- define "kvfleet.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kvfleet.name" $root }}-{{ index . 1 }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kvfleet.componentLabels" -}}
{{ include "kvfleet.labels" (index . 0) }}
{{ include "kvfleet.selectorLabels" . }}
{{- end -}}

{{/* An image reference with an explicit tag: the given tag, else the chart's appVersion. */}}
{{- define "kvfleet.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag | toString) -}}
{{- end -}}

{{- define "kvfleet.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "kvfleet.componentName" (list . "operator")) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvfleet.gateway.serviceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create -}}
{{- default (include "kvfleet.componentName" (list . "gateway")) .Values.gateway.serviceAccount.name -}}
{{- else -}}
{{- required "gateway.serviceAccount.name is required when gateway.serviceAccount.create is false" .Values.gateway.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespace of the fleet the gateway fronts. */}}
{{- define "kvfleet.gateway.fleetNamespace" -}}
{{- default .Release.Namespace .Values.gateway.fleetNamespace -}}
{{- end -}}

{{/* The namespaces the operator watches when it is not cluster-wide: the release namespace first, no repeats. */}}
{{- define "kvfleet.operator.namespaces" -}}
{{- $namespaces := list .Release.Namespace -}}
{{- range .Values.operator.watchNamespaces -}}
{{- $namespaces = append $namespaces . -}}
{{- end -}}
{{- $namespaces | uniq | join "," -}}
{{- end -}}

{{/* Redis: "external" (a URL the user gives), "embedded" (the chart's StatefulSet) or "none" (in-process queues). */}}
{{- define "kvfleet.redis.mode" -}}
{{- if or .Values.redis.external.url .Values.redis.external.existingSecret -}}
external
{{- else if .Values.redis.enabled -}}
embedded
{{- else -}}
none
{{- end -}}
{{- end -}}

{{- define "kvfleet.redis.fullname" -}}
{{- include "kvfleet.componentName" (list . "redis") -}}
{{- end -}}

{{/* The Secret and key that hold the Redis URL (with its password), which the gateway and the operator read. */}}
{{- define "kvfleet.redis.urlSecretName" -}}
{{- if .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecret -}}
{{- else -}}
{{- include "kvfleet.redis.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "kvfleet.redis.urlSecretKey" -}}
{{- if .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecretKey -}}
{{- else -}}
redis-url
{{- end -}}
{{- end -}}

{{/* The env entry that hands the Redis URL to a container without writing it into the pod spec; the container
passes it on as `--redis-url $(KVFLEET_REDIS_URL)`. */}}
{{- define "kvfleet.redis.urlEnv" -}}
- name: KVFLEET_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "kvfleet.redis.urlSecretName" . }}
      key: {{ include "kvfleet.redis.urlSecretKey" . }}
{{- end -}}

{{/* The hardened securityContext every container gets. */}}
{{- define "kvfleet.containerSecurityContext" -}}
runAsNonRoot: true
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Pod-level: a numeric non-root user (the images' USER), the RuntimeDefault seccomp profile. */}}
{{- define "kvfleet.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ . }}
runAsGroup: {{ . }}
fsGroup: {{ . }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The Secret holding the engines' shared token (key api-key): the given existing one, else the chart's. */}}
{{- define "kvfleet.engineAuth.secretName" -}}
{{- default (include "kvfleet.componentName" (list . "engine-auth")) .Values.engineAuth.existingSecret -}}
{{- end -}}

{{/* The env entry that hands the engines' token to a container (the gateway sends it upstream). */}}
{{- define "kvfleet.engineAuth.env" -}}
- name: KVFLEET_ENGINE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kvfleet.engineAuth.secretName" . }}
      key: api-key
{{- end -}}

{{/* Namespaces that hold engine pods this release knows of: its own, the watched ones, the gateway's fleet's. */}}
{{- define "kvfleet.engineNamespaces" -}}
{{- $namespaces := list .Release.Namespace -}}
{{- if .Values.operator.enabled -}}
{{- range .Values.operator.watchNamespaces -}}
{{- $namespaces = append $namespaces . -}}
{{- end -}}
{{- end -}}
{{- $namespaces = append $namespaces (include "kvfleet.gateway.fleetNamespace" .) -}}
{{- $namespaces | uniq | join "," -}}
{{- end -}}

{{/* The gateway's mode (values gateway.mode): envoy, python or inferencePool; checks what a mode needs. */}}
{{- define "kvfleet.gateway.mode" -}}
{{- $g := .Values.gateway -}}
{{- if and (eq $g.mode "inferencePool") (ne (include "kvfleet.gateway.fleetNamespace" .) .Release.Namespace) -}}
{{- fail "gateway.mode=inferencePool needs the fleet in the release namespace (gateway.fleetNamespace empty): an InferencePool selects pods of its own namespace and names a picker Service there" -}}
{{- end -}}
{{- if and (eq $g.mode "envoy") (ge (int $g.envoy.drainSeconds) (int $g.terminationGracePeriodSeconds)) -}}
{{- fail "gateway.envoy.drainSeconds must be shorter than gateway.terminationGracePeriodSeconds" -}}
{{- end -}}
{{- $g.mode -}}
{{- end -}}

{{/* Where the envoy mode's init container writes Envoy's bootstrap and the gateway keeps the engines' EDS file
(a folder of its own, which Envoy watches): one emptyDir that the three containers share. */}}
{{- define "kvfleet.gateway.envoyDir" -}}/etc/kvfleet-envoy{{- end -}}

{{/* `kvfleet gateway` flags of the mode, shared word for word by the gateway container and, in envoy mode, the
init container that writes Envoy's bootstrap from them (gateway/envoy/sidecar.py); the Redis URL is added by the
gateway container alone (the bootstrap needs no secret). */}}
{{- define "kvfleet.gateway.flags" -}}
{{- $g := .Values.gateway -}}
{{- $mode := include "kvfleet.gateway.mode" . -}}
- --host=0.0.0.0
{{- if eq $mode "envoy" }}
- --data-plane=envoy-sidecar
- --port={{ $g.appPort }}
- --picker-port={{ $g.pickerPort }}
- --envoy-endpoints-file={{ include "kvfleet.gateway.envoyDir" . }}/engines/engines.json
{{- else if eq $mode "inferencePool" }}
- --data-plane=picker
- --port={{ $g.port }}
- --picker-port={{ $g.pickerPort }}
{{- else }}
- --data-plane=python
- --port={{ $g.port }}
{{- end }}
- --k8s-namespace={{ include "kvfleet.gateway.fleetNamespace" . }}
{{- if $g.fleetSelector }}
# Every InferenceFleet with these labels, each by its spec.model (gateway/models/inference_fleets.py).
- --k8s-fleet-selector={{ $g.fleetSelector }}
{{- else if $g.fleets }}
{{- range $g.fleets }}
- --k8s-fleet={{ . }}
{{- end }}
{{- else }}
- --fleet={{ $g.fleet }}
# The engine pods the operator creates for the fleet carry this label (operator/manifests.py).
- --k8s-selector=kvfleet.io/fleet={{ $g.fleet }}
{{- end }}
- --routing={{ $g.routing }}
{{- with $g.tokenizer }}
- --tokenizer={{ . }}
{{- end }}
- --max-queue-ms={{ $g.maxQueueMs }}
{{- with $g.queueCaps }}
- --queue-caps={{ . }}
{{- end }}
{{- with $g.degradeMaxTokens }}
- --degrade-max-tokens={{ . }}
{{- end }}
{{- with $g.queuePolicy }}
- --queue-policy={{ . }}
{{- end }}
{{- if not (kindIs "invalid" $g.tenantMaxQueued) }}
- --tenant-max-queued={{ $g.tenantMaxQueued }}
{{- end }}
{{- if not (kindIs "invalid" $g.tenantMaxInflight) }}
- --tenant-max-inflight={{ $g.tenantMaxInflight }}
{{- end }}
- --tenant-metrics-top={{ $g.tenantMetricsTop }}
{{- with $g.apiKeysSecret }}
- --api-keys-secret={{ include "kvfleet.gateway.fleetNamespace" $ }}/{{ . }}
{{- end }}
{{- if $g.batch.enabled }}
{{- if eq (include "kvfleet.redis.mode" .) "none" }}
{{- fail "gateway.batch.enabled needs Redis (redis.enabled or redis.external.url): batches and their progress live there" }}
{{- end }}
# The Batch API: file bodies in the bucket or on the volume every replica mounts, state in Redis.
{{- if $g.batch.storeUrl }}
- --batch-store={{ $g.batch.storeUrl }}
{{- else }}
- --batch-dir={{ include "kvfleet.gateway.batchDir" . }}
{{- end }}
- --batch-max-file-bytes={{ int64 $g.batch.maxFileBytes }}
- --batch-max-lines={{ int64 $g.batch.maxLines }}
- --batch-max-active={{ int64 $g.batch.maxActive }}
- --batch-share={{ $g.batch.share }}
- --batch-file-ttl={{ int64 $g.batch.fileTtlSeconds }}
{{- with $g.batch.maxTokens }}
- --batch-max-tokens={{ int64 . }}
{{- end }}
{{- end }}
{{- range $g.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The Inference-Extension Gateway's proxy pods (a NetworkPolicy peer): the given selectors, else the pods of
the Gateway named by gatewayRef (Gateway API's gateway.networking.k8s.io/gateway-name label) in its namespace. */}}
{{- define "kvfleet.inferencePool.gatewayPeer" -}}
{{- $ip := .Values.gateway.inferencePool -}}
{{- if $ip.gatewayPods -}}
namespaceSelector:
  {{- toYaml ($ip.gatewayPods.namespaceSelector | default dict) | nindent 2 }}
podSelector:
  {{- toYaml ($ip.gatewayPods.podSelector | default dict) | nindent 2 }}
{{- else -}}
namespaceSelector:
  matchLabels:
    kubernetes.io/metadata.name: {{ default .Release.Namespace $ip.gatewayRef.namespace }}
podSelector:
  matchLabels:
    gateway.networking.k8s.io/gateway-name: {{ $ip.gatewayRef.name }}
{{- end -}}
{{- end -}}

{{/* Where the gateway keeps the Batch API's files, and the claim they are on. */}}
{{- define "kvfleet.gateway.batchDir" -}}/var/lib/kvfleet/batch{{- end -}}
{{- define "kvfleet.gateway.batchClaim" -}}
{{- default (include "kvfleet.componentName" (list . "batch-files")) .Values.gateway.batch.existingClaim -}}
{{- end -}}
