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

{{/* Serve's config (serveConfigV2): deploy/config.yaml's application from values, with serve.argOverrides and then
splitPlacement's args merged over its args and serve.autoscaling over its deployment's autoscaling_config; the HTTP
proxy listens on every interface of every node. */}}
{{- define "dsde.serveConfig" -}}
{{- $app := deepCopy .Values.serve.application -}}
{{- range $key, $value := .Values.serve.argOverrides -}}
{{- $_ := set $app.args $key $value -}}
{{- end -}}
{{- with .Values.splitPlacement -}}
{{- if .enabled -}}
{{- $_ := set $app.args "draft_num_gpus" 0 -}}
{{- $_ := set $app.args "draft_num_cpus" .draftCpus -}}
{{- $_ := set $app.args "target_num_gpus" .targetGpus -}}
{{- $_ := set $app.args "draft_resources" (dict .draftResource 1) -}}
{{- $_ := set $app.args "target_resources" (dict .targetResource 1) -}}
{{- $_ := set $app.args "placement_strategy" .strategy -}}
{{- end -}}
{{- end -}}
{{- with .Values.serve.autoscaling -}}
{{- $deployment := index $app.deployments 0 -}}
{{- $_ := set $deployment "autoscaling_config" (merge (deepCopy .) (default (dict) $deployment.autoscaling_config)) -}}
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


{{/* A custom resource a worker advertises, as rayStartParams' `resources` (KubeRay puts it on `ray start`'s shell
command line, so the JSON's quotes are escaped and the whole is quoted): "{\"dsde_draft\": 2}". */}}
{{- define "dsde.rayResources" -}}
{{- printf "\"%s\"" (toJson . | replace "\"" "\\\"") -}}
{{- end -}}

{{/* One worker group: `group` its values (groupName, replicas, rayStartParams, resources, nodeSelector, ...),
`gpus` its GPUs per pod, `resource` the custom resource it advertises ({} none), `root` the chart's context. */}}
{{- define "dsde.workerGroup" -}}
{{- $root := .root -}}
{{- $group := .group -}}
- groupName: {{ $group.groupName }}
  replicas: {{ $group.replicas }}
  minReplicas: {{ $group.minReplicas }}
  maxReplicas: {{ $group.maxReplicas }}
  rayStartParams:
    {{- $start := dict "metrics-export-port" (toString $root.Values.metricsPort) }}
    {{- if gt (int .gpus) 0 }}
    {{- $_ := set $start "num-gpus" (toString .gpus) }}
    {{- end }}
    {{- if .resource }}
    {{- $_ := set $start "resources" (include "dsde.rayResources" .resource) }}
    {{- end }}
    {{- range $key, $value := merge (deepCopy (default (dict) $group.rayStartParams)) $start }}
    {{ $key }}: {{ $value | toString | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "dsde.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: ray-worker
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      containers:
        - name: ray-worker
          image: {{ include "dsde.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          ports:
            - name: serve
              containerPort: {{ $root.Values.serve.httpPort }}
              protocol: TCP
            {{- include "dsde.metricsPort" $root | nindent 12 }}
          {{- with $root.Values.env }}
          env:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- $resources := deepCopy (default (dict) $group.resources) }}
          {{- if gt (int .gpus) 0 }}
          {{- $limits := merge (dict "nvidia.com/gpu" (toString .gpus)) (default (dict) $resources.limits) }}
          {{- $_ := set $resources "limits" $limits }}
          {{- end }}
          resources:
            {{- toYaml $resources | nindent 12 }}
      {{- with $group.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
