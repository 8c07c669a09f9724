{{/* The chart's name, or nameOverride. */}}
{{- define "dsde.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The RayService's name: KubeRay derives the RayCluster's, its pods' and its Services' names from it, so it is
kept short (40 characters). */}}
{{- define "dsde.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "dsde.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "dsde.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dsde.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dsde.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dsde.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "dsde.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "dsde.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Serve's config (serveConfigV2): deploy/config.yaml's application from values, with serve.argOverrides merged
over its args; the HTTP proxy listens on every interface of every node. */}}
{{- define "dsde.serveConfig" -}}
{{- $app := deepCopy .Values.serve.application -}}
{{- range $key, $value := .Values.serve.argOverrides -}}
{{- $_ := set $app.args $key $value -}}
{{- end -}}
proxy_location: {{ .Values.serve.proxyLocation }}
http_options:
  host: 0.0.0.0
  port: {{ .Values.serve.httpPort }}
applications:
{{ list $app | toYaml }}
{{- end -}}

{{/* Ports of every Ray container: Ray's metrics export port is named `metrics` (the PodMonitor scrapes it). */}}
{{- define "dsde.metricsPort" -}}
- name: metrics
  containerPort: {{ .Values.metricsPort }}
  protocol: TCP
{{- end -}}
