{{/*
RBAC rules, defined once and used by the namespace-scoped Roles and the cluster-scoped
ClusterRoles. They list exactly what the code calls (SPEC §7); no wildcards.
*/}}
{{- define "lorafleet.operatorRules" -}}
# DynamoModels: watch, patch (finalizer, kopf progress annotations) and write status.
- apiGroups: [nvidia.com]
  resources: [dynamomodels]
  verbs: [get, list, watch, patch]
- apiGroups: [nvidia.com]
  resources: [dynamomodels/status]
  verbs: [get, patch]
# Owner references with blockOwnerDeletion on sync Jobs need update on the finalizers subresource.
- apiGroups: [nvidia.com]
  resources: [dynamomodels/finalizers]
  verbs: [update]
# Worker pods: the index by base-model hash.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# Worker pods' readiness gate lorafleet.dev/adapters-loaded (gates.py): one condition in their status.
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
# Sync Jobs (hf:// -> object store).
- apiGroups: [batch]
  resources: [jobs]
  verbs: [create, get, list, watch, delete]
# Events for every load/unload/sync outcome (kopf posts core/v1 events).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create]
# The ledger of adapter names the operator placed (one ConfigMap per namespace, see ledger.py).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [create]
- apiGroups: [""]
  resources: [configmaps]
  resourceNames: [lorafleet-adapters]
  verbs: [get, patch]
{{- with include "lorafleet.copiedSecrets" . | fromJsonArray }}
# Sync Jobs read the store keys and HF_TOKEN in their own namespace: the operator keeps copies of
# the store Secret and the HF token Secret there (create; get/update of those names only).
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: [""]
  resources: [secrets]
  resourceNames: {{ toJson . }}
  verbs: [get, update]
{{- end }}
{{- end }}

{{/* The Secrets copied where sync Jobs run (JSON list; empty when Jobs run only in the release
namespace): the store Secret, and the HF token Secret when an object store is configured. */}}
{{- define "lorafleet.copiedSecrets" -}}
{{- $elsewhere := or (eq .Values.rbac.scope "cluster") (without .Values.rbac.watchNamespaces .Release.Namespace) }}
{{- $names := list }}
{{- if and $elsewhere (ne .Values.store.mode "none") }}
{{- with include "lorafleet.storeSecret" . }}{{ $names = append $names . }}{{ end }}
{{- with .Values.huggingface.tokenSecret }}{{ $names = append $names . }}{{ end }}
{{- end }}
{{- toJson $names }}
{{- end }}

{{/* Leader election (operator.replicas > 1): the Lease lorafleet-operator in the release namespace. */}}
{{- define "lorafleet.leaderRules" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [lorafleet-operator]
  verbs: [get, update]
{{- end }}

{{- define "lorafleet.routerRules" -}}
# The router reads DynamoModels (status.endpoints) and worker pods; it writes nothing.
- apiGroups: [nvidia.com]
  resources: [dynamomodels]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
{{- end }}

{{/* Secrets the operator may read, by name only, in the release namespace. */}}
{{- define "lorafleet.operatorSecretNames" -}}
{{- $names := list }}
{{- if .Values.adminToken.enabled }}{{ $names = append $names (include "lorafleet.adminTokenSecret" .) }}{{ end }}
{{- with include "lorafleet.storeSecret" . }}{{ $names = append $names . }}{{ end }}
{{- with .Values.huggingface.tokenSecret }}{{ $names = append $names . }}{{ end }}
{{- if include "lorafleet.apiKeyGenerated" . }}{{ $names = append $names (include "lorafleet.apiKeySecret" .) }}{{ end }}
{{- toJson $names }}
{{- end }}

{{/*
Role+RoleBinding per watched namespace (rbac.scope=namespace) or one ClusterRole+ClusterRoleBinding
(rbac.scope=cluster) for a component: (dict "root" $ "component" "router" "sa" NAME "rules" "lorafleet.routerRules").
*/}}
{{- define "lorafleet.scopedRBAC" -}}
{{- $root := .root }}
{{- $name := printf "%s-%s" (include "lorafleet.fullname" $root) .component }}
{{- $labels := include "lorafleet.componentLabels" (dict "root" $root "component" .component) }}
{{- $cluster := eq $root.Values.rbac.scope "cluster" }}
{{- $namespaces := ternary (list "") (splitList "," (include "lorafleet.watchNamespaces" $root)) $cluster }}
{{- range $ns := $namespaces }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: {{ ternary "ClusterRole" "Role" $cluster }}
metadata:
  name: {{ $name }}
  {{- if not $cluster }}
  namespace: {{ $ns }}
  {{- end }}
  labels:
    {{- $labels | nindent 4 }}
rules:
  {{- include $.rules $root | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: {{ ternary "ClusterRoleBinding" "RoleBinding" $cluster }}
metadata:
  name: {{ $name }}
  {{- if not $cluster }}
  namespace: {{ $ns }}
  {{- end }}
  labels:
    {{- $labels | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: {{ ternary "ClusterRole" "Role" $cluster }}
  name: {{ $name }}
subjects:
  - kind: ServiceAccount
    name: {{ $.sa }}
    namespace: {{ $root.Release.Namespace }}
{{- end }}
{{- end }}
