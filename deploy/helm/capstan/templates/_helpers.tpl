{{/*
The chart's name, or nameOverride.
*/}}
{{- define "capstan.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The objects' base name: fullnameOverride, else the release name if it contains the
chart's name (`capstan` for a release named capstan, as in deploy/), else
RELEASE-NAME. Truncated to 63 characters, the limit of some name fields.
*/}}
{{- define "capstan.fullname" -}}
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

{{/*
Labels of every object: Kubernetes' recommended ones. deploy/base sets the same, except
the two that name the installing tool (helm.sh/chart, app.kubernetes.io/managed-by).
*/}}
{{- define "capstan.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "capstan.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: capstan
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels that select the Pods (Deployment and Service).
*/}}
{{- define "capstan.selectorLabels" -}}
app.kubernetes.io/name: {{ include "capstan.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The ServiceAccount the Pods run as.
*/}}
{{- define "capstan.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "capstan.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is needed when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image, repository:tag (the tag defaults to the chart's appVersion).
*/}}
{{- define "capstan.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/*
Pods of the Deployment: replicaCount, else 2 with leader election and 3 with sharding.
*/}}
{{- define "capstan.replicas" -}}
{{- if kindIs "invalid" .Values.replicaCount }}
{{- ternary 3 2 .Values.sharding.enabled }}
{{- else }}
{{- .Values.replicaCount }}
{{- end }}
{{- end }}
