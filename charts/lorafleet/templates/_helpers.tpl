{{/* Chart name, truncated to the DNS label limit. */}}
{{- define "lorafleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release name already holds the chart name. */}}
{{- define "lorafleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Common labels. */}}
{{- define "lorafleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "lorafleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lorafleet
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "lorafleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lorafleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: (dict "root" $ "component" "operator"). */}}
{{- define "lorafleet.componentLabels" -}}
{{ include "lorafleet.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "lorafleet.componentSelector" -}}
{{ include "lorafleet.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Image reference [global.imageRegistry/]repository:tag[@digest]: (dict "image" .Values.image.operator "root" $). */}}
{{- define "lorafleet.image" -}}
{{- $registry := ((.root.Values.global).imageRegistry) | default "" }}
{{- $repo := ternary (printf "%s/%s" (trimSuffix "/" $registry) .image.repository) .image.repository (ne $registry "") }}
{{- $ref := printf "%s:%s" $repo (default .root.Chart.AppVersion .image.tag) }}
{{- with .image.digest }}{{ $ref = printf "%s@%s" $ref . }}{{ end }}
{{- $ref }}
{{- end }}

{{/* Pull secret names, comma separated: global.imagePullSecrets then imagePullSecrets
(entries {name: x} or plain names), each once. */}}
{{- define "lorafleet.imagePullSecretNames" -}}
{{- $names := list }}
{{- range concat (((.Values.global).imagePullSecrets) | default list) .Values.imagePullSecrets }}
{{- $name := kindIs "map" . | ternary (get (kindIs "map" . | ternary . dict) "name") (toString .) }}
{{- if and $name (not (has $name $names)) }}{{ $names = append $names $name }}{{ end }}
{{- end }}
{{- join "," $names }}
{{- end }}

{{- define "lorafleet.imagePullSecrets" -}}
{{- with include "lorafleet.imagePullSecretNames" . }}
imagePullSecrets:
{{- range splitList "," . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* Pod-level fields shared by every Deployment of the chart: (dict "root" $ "pod" .Values.router). */}}
{{- define "lorafleet.podExtras" -}}
{{- with .pod.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .pod.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "lorafleet.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (printf "%s-operator" (include "lorafleet.fullname" .)) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "lorafleet.routerServiceAccount" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (printf "%s-router" (include "lorafleet.fullname" .)) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "lorafleet.workerServiceAccount" -}}
{{- if .Values.workerServiceAccount.create }}
{{- default (printf "%s-worker" (include "lorafleet.fullname" .)) .Values.workerServiceAccount.name }}
{{- else }}
{{- default "default" .Values.workerServiceAccount.name }}
{{- end }}
{{- end }}

{{/* ServiceAccount of sync Job pods ("" = the namespace's default). */}}
{{- define "lorafleet.syncServiceAccount" -}}
{{- $sa := .Values.operator.syncJob.serviceAccount }}
{{- if and $sa.create (eq .Values.rbac.scope "namespace") (ne .Values.store.mode "none") }}
{{- default (printf "%s-sync" (include "lorafleet.fullname" .)) $sa.name }}
{{- else }}
{{- $sa.name }}
{{- end }}
{{- end }}

{{/* Namespaces the operator and router manage (namespace scope). */}}
{{- define "lorafleet.watchNamespaces" -}}
{{- if .Values.rbac.watchNamespaces }}
{{- join "," .Values.rbac.watchNamespaces }}
{{- else }}
{{- .Release.Namespace }}
{{- end }}
{{- end }}

{{/* Env selecting what the operator / router watch (both settings classes read LORAFLEET_NAMESPACES / LORAFLEET_ALL_NAMESPACES: envflags.WatchScope). */}}
{{- define "lorafleet.scopeEnv" -}}
{{- if eq .Values.rbac.scope "cluster" -}}
- name: LORAFLEET_ALL_NAMESPACES
  value: "true"
{{- else if .Values.rbac.watchNamespaces -}}
- name: LORAFLEET_NAMESPACES
  value: {{ include "lorafleet.watchNamespaces" . | quote }}
{{- else -}}
# No LORAFLEET_NAMESPACES: the pod's own namespace (POD_NAMESPACE), right under a kustomize namespace override.
{{- end }}
- name: LORAFLEET_BIND_HOST
  value: {{ include "lorafleet.listenHost" . | quote }}
{{- end }}

{{- define "lorafleet.adminTokenSecret" -}}
{{- default (printf "%s-admin-token" (include "lorafleet.fullname" .)) .Values.adminToken.existingSecret }}
{{- end }}

{{/* "true" when the operator generates the admin token at run time (no value, no existingSecret). */}}
{{- define "lorafleet.adminTokenGenerated" -}}
{{- if and .Values.adminToken.enabled (not .Values.adminToken.existingSecret) (not .Values.adminToken.value) }}true{{ end }}
{{- end }}

{{/* "true" when the store keys are given as values (rendered into the chart's Secret). */}}
{{- define "lorafleet.storeKeysGiven" -}}
{{- if and .Values.store.accessKeyId .Values.store.secretAccessKey }}true{{ end }}
{{- end }}

{{/* "true" when the operator generates the MinIO keys at run time. */}}
{{- define "lorafleet.storeKeysGenerated" -}}
{{- if and (eq .Values.store.mode "minio") (not .Values.store.existingSecret) (not (include "lorafleet.storeKeysGiven" .)) }}true{{ end }}
{{- end }}

{{/* Name of the Secret with the store keys; empty = none (boto3's default credential chain). */}}
{{- define "lorafleet.storeSecret" -}}
{{- if ne .Values.store.mode "none" }}
{{- if .Values.store.existingSecret }}
{{- .Values.store.existingSecret }}
{{- else if or (include "lorafleet.storeKeysGiven" .) (include "lorafleet.storeKeysGenerated" .) }}
{{- printf "%s-store" (include "lorafleet.fullname" .) }}
{{- end }}
{{- end }}
{{- end }}

{{/* LORAFLEET_GENERATED_SECRETS: {secret: {key: length}} the operator creates once at run time. */}}
{{- define "lorafleet.generatedSecrets" -}}
{{- $out := dict }}
{{- if include "lorafleet.adminTokenGenerated" . }}
{{- $_ := set $out (include "lorafleet.adminTokenSecret" .) (dict .Values.adminToken.key 48) }}
{{- end }}
{{- if include "lorafleet.storeKeysGenerated" . }}
{{- $_ := set $out (include "lorafleet.storeSecret" .) (dict "AWS_ACCESS_KEY_ID" 20 "AWS_SECRET_ACCESS_KEY" 40) }}
{{- end }}
{{- if include "lorafleet.apiKeyGenerated" . }}
{{- $_ := set $out (include "lorafleet.apiKeySecret" .) (dict .Values.auth.apiKey.key 48) }}
{{- end }}
{{- if $out }}{{ toJson $out }}{{ end }}
{{- end }}

{{- define "lorafleet.storeConfig" -}}
{{- printf "%s-store" (include "lorafleet.fullname" .) }}
{{- end }}

{{- define "lorafleet.minio" -}}
{{- printf "%s-minio" (include "lorafleet.fullname" .) }}
{{- end }}

{{/* Listen address of a server in a lorafleet pod. */}}
{{- define "lorafleet.listenHost" -}}
{{- if .Values.listenOnPodIP }}$(POD_IP){{ else }}0.0.0.0{{ end }}
{{- end }}

{{/* Env shared by every lorafleet container: pod identity. */}}
{{- define "lorafleet.podEnv" -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
{{- end }}

{{/* envFrom for containers that talk to the object store (absent with store.mode=none);
(dict "root" $ "keys" true) adds the store Secret's keys when there is one. */}}
{{- define "lorafleet.storeEnvFrom" -}}
{{- $root := .root }}
{{- if ne $root.Values.store.mode "none" -}}
envFrom:
  - configMapRef:
      name: {{ include "lorafleet.storeConfig" $root }}
  {{- with and .keys (include "lorafleet.storeSecret" $root) }}
  - secretRef:
      name: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{/* The admin token as LORAFLEET_ADMIN_TOKEN (pods wait until the Secret exists). */}}
{{- define "lorafleet.adminTokenEnv" -}}
{{- if .Values.adminToken.enabled -}}
- name: LORAFLEET_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "lorafleet.adminTokenSecret" . }}
      key: {{ .Values.adminToken.key }}
{{- end }}
{{- end }}

{{/* Base-model hash label value (Dynamo's convention): first 8 hex of sha256(name). */}}
{{- define "lorafleet.baseModelHash" -}}
{{- . | sha256sum | trunc 8 }}
{{- end }}

{{/* A NetworkPolicy `from` entry for a values peer {podSelector, namespaceSelector}: the pods matching
podSelector in the namespaces matching namespaceSelector ({} = every namespace); nothing when both are empty. */}}
{{- define "lorafleet.networkPeer" -}}
{{- if or .podSelector .namespaceSelector -}}
- namespaceSelector: {{ toJson (.namespaceSelector | default dict) }}
  podSelector: {{ toJson (.podSelector | default dict) }}
{{- end }}
{{- end }}

{{/* "true" when inference needs an API key (auth.apiKey: value, existingSecret or generate). */}}
{{- define "lorafleet.apiKeyEnabled" -}}
{{- with .Values.auth.apiKey }}{{ if or .value .existingSecret .generate }}true{{ end }}{{ end }}
{{- end }}

{{- define "lorafleet.apiKeySecret" -}}
{{- default (printf "%s-api-key" (include "lorafleet.fullname" .)) .Values.auth.apiKey.existingSecret }}
{{- end }}

{{/* "true" when the operator generates the API key at run time (generate, no value, no existingSecret). */}}
{{- define "lorafleet.apiKeyGenerated" -}}
{{- with .Values.auth.apiKey }}{{ if and .generate (not .existingSecret) (not .value) }}true{{ end }}{{ end }}
{{- end }}

{{/* The API key as LORAFLEET_API_KEY, for the router and the workers (pods wait until the Secret exists). */}}
{{- define "lorafleet.apiKeyEnv" -}}
{{- if include "lorafleet.apiKeyEnabled" . -}}
- name: LORAFLEET_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "lorafleet.apiKeySecret" . }}
      key: {{ .Values.auth.apiKey.key }}
{{- end }}
{{- end }}
