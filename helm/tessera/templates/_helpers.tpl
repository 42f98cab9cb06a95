{{/* The release's name for every object: RELEASE-tessera, or the release name when it already says tessera. */}}
{{- define "tessera.fullname" -}}
{{- if contains "tessera" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-tessera" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tessera.labels" -}}
app.kubernetes.io/name: tessera
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tessera.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* The model (read-only) and the scratch volume (RocksDB), on every pod. */}}
{{- define "tessera.volumes" -}}
- name: model
{{- if .Values.model.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
    readOnly: true
{{- else if .Values.model.hostPath }}
  hostPath:
    path: {{ .Values.model.hostPath }}
    type: Directory
{{- else }}
  {{- fail "set model.existingClaim or model.hostPath: every pod reads the model from the same path" }}
{{- end }}
- name: data
  emptyDir:
    sizeLimit: {{ .Values.storage.sizeLimit }}
{{- end -}}

{{- define "tessera.volumeMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
- name: data
  mountPath: {{ .Values.storage.mountPath }}
{{- end -}}
