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

{{/* Image reference: (dict "image" .Values.image.operator "root" $). */}}
{{- define "lorafleet.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
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
{{- printf "%s-worker" (include "lorafleet.fullname" .) }}
{{- end }}

{{/* Namespaces the operator and router manage (namespace scope). */}}
{{- define "lorafleet.watchNamespaces" -}}
{{- if .Values.rbac.watchNamespaces }}
{{- join "," .Values.rbac.watchNamespaces }}
{{- else }}
{{- .Release.Namespace }}
{{- end }}
{{- end }}

{{/* Env selecting what the operator / router watch (Settings: LORAFLEET_NAMESPACES / LORAFLEET_ALL_NAMESPACES). */}}
{{- define "lorafleet.scopeEnv" -}}
{{- if eq .Values.rbac.scope "cluster" -}}
- name: LORAFLEET_ALL_NAMESPACES
  value: "true"
{{- else -}}
- name: LORAFLEET_NAMESPACES
  value: {{ include "lorafleet.watchNamespaces" . | quote }}
{{- end }}
- name: LORAFLEET_BIND_HOST
  value: {{ include "lorafleet.listenHost" . | quote }}
{{- end }}

{{- define "lorafleet.adminTokenSecret" -}}
{{- default (printf "%s-admin-token" (include "lorafleet.fullname" .)) .Values.adminToken.existingSecret }}
{{- end }}

{{- define "lorafleet.storeSecret" -}}
{{- default (printf "%s-store" (include "lorafleet.fullname" .)) .Values.store.existingSecret }}
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

{{/* envFrom for containers that talk to the object store (absent with store.mode=none). */}}
{{- define "lorafleet.storeEnvFrom" -}}
{{- if ne .Values.store.mode "none" -}}
envFrom:
  - configMapRef:
      name: {{ include "lorafleet.storeConfig" . }}
  - secretRef:
      name: {{ include "lorafleet.storeSecret" . }}
{{- end }}
{{- end }}

{{/* The admin token as LORAFLEET_ADMIN_TOKEN. */}}
{{- define "lorafleet.adminTokenEnv" -}}
{{- if .Values.adminToken.enabled -}}
- name: LORAFLEET_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "lorafleet.adminTokenSecret" . }}
      key: {{ .Values.adminToken.key }}
{{- end }}
{{- end }}

{{/* A value kept across upgrades: the existing Secret's key, else the given value, else random. */}}
{{- define "lorafleet.persistentSecretValue" -}}
{{- $existing := lookup "v1" "Secret" .namespace .secret }}
{{- if .value }}
{{- .value }}
{{- else if and $existing (hasKey $existing.data .key) }}
{{- index $existing.data .key | b64dec }}
{{- else }}
{{- randAlphaNum (int .length) }}
{{- end }}
{{- end }}

{{/* Base-model hash label value (Dynamo's convention): first 8 hex of sha256(name). */}}
{{- define "lorafleet.baseModelHash" -}}
{{- . | sha256sum | trunc 8 }}
{{- end }}
