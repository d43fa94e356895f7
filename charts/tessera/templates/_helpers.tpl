{{/* Names, labels and shared fragments of the Tessera chart. */}}

{{- define "tessera.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object name; kept short enough for "-plugin-server-token". */}}
{{- define "tessera.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tessera.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "scheduler"). */}}
{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tessera.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects: (dict "root" $ "component" "scheduler"). */}}
{{- define "tessera.componentLabels" -}}
{{ include "tessera.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "tessera.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* ServiceAccount names, one per component. */}}
{{- define "tessera.schedulerServiceAccount" -}}
{{ include "tessera.fullname" . }}-scheduler
{{- end }}

{{- define "tessera.pluginServerServiceAccount" -}}
{{- if .Values.scheduler.separateIdentities }}
{{- include "tessera.fullname" . }}-plugin-server
{{- else }}
{{- include "tessera.schedulerServiceAccount" . }}
{{- end }}
{{- end }}

{{- define "tessera.webhookServiceAccount" -}}
{{- if .Values.scheduler.separateIdentities }}
{{- include "tessera.fullname" . }}-webhook
{{- else }}
{{- include "tessera.schedulerServiceAccount" . }}
{{- end }}
{{- end }}

{{- define "tessera.nodeAgentServiceAccount" -}}
{{ include "tessera.fullname" . }}-node-agent
{{- end }}

{{/* The user name the API server gives a ServiceAccount: (dict "root" $ "sa" NAME). */}}
{{- define "tessera.saUser" -}}
system:serviceaccount:{{ .root.Release.Namespace }}:{{ .sa }}
{{- end }}

{{- define "tessera.schedulerServiceName" -}}
{{ include "tessera.fullname" . }}-scheduler
{{- end }}

{{- define "tessera.webhookTlsSecret" -}}
{{- default (printf "%s-webhook-tls" (include "tessera.fullname" .)) .Values.webhook.tls.existingSecret }}
{{- end }}

{{/* The device configuration text (deviceConfigYaml wins over deviceConfig). */}}
{{- define "tessera.deviceConfig" -}}
{{- if .Values.deviceConfigYaml }}
{{- .Values.deviceConfigYaml }}
{{- else }}
{{- toYaml .Values.deviceConfig }}
{{- end }}
{{- end }}

{{/* Where the plugin server's socket lives: a 0700 directory it creates inside the emptyDir
shared with tessera-scheduler. */}}
{{- define "tessera.socketDir" -}}/run/tessera{{- end }}
{{- define "tessera.socketPath" -}}/run/tessera/plugin/plugin.sock{{- end }}

{{- define "tessera.deviceConfigPath" -}}/etc/tessera/device-config/device-config.yaml{{- end }}

{{/* The standard in-cluster credential path every client (client-go, Tessera) reads. */}}
{{- define "tessera.saTokenDir" -}}/var/run/secrets/kubernetes.io/serviceaccount{{- end }}

{{- /*
Users whose pod writes may alter Tessera's internal annotations: the plugin server and node
agent service accounts, plus webhook.trustedUsers. A list, one per line.
*/}}
{{- define "tessera.trustedUsers" -}}
{{- $users := list (include "tessera.saUser" (dict "root" . "sa" (include "tessera.pluginServerServiceAccount" .))) }}
{{- if .Values.nodeAgent.enabled }}
{{- $users = append $users (include "tessera.saUser" (dict "root" . "sa" (include "tessera.nodeAgentServiceAccount" .))) }}
{{- end }}
{{- range (concat $users .Values.webhook.trustedUsers | uniq) }}
{{ . }}
{{- end }}
{{- end }}
