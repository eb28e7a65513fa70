{{/* A worker group's topologySpreadConstraints (dict "root" $ "group" $w): each entry as given, with the
group's own pod labels as labelSelector when it names none. Empty when the group has none. */}}
{{- define "lorafleet.workerSpread" -}}
{{- $selector := fromYaml (include "lorafleet.componentSelector" (dict "root" .root "component" "worker")) }}
{{- $_ := set $selector "lorafleet.dev/worker-group" .group.name }}
{{- $spread := list }}
{{- range .group.topologySpreadConstraints }}
{{- $entry := deepCopy . }}
{{- if not (hasKey $entry "labelSelector") }}{{ $_ := set $entry "labelSelector" (dict "matchLabels" $selector) }}{{ end }}
{{- $spread = append $spread $entry }}
{{- end }}
{{- with $spread }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
