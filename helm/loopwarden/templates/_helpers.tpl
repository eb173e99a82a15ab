{{/*
Names and labels shared by every template.
*/}}

{{- define "loopwarden.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
<release>-<chart>, or just the release name when it already contains the chart name; cut to 52
characters, since a StatefulSet adds "-<ordinal>" and a controller-revision hash to its pods' labels.
*/}}
{{- define "loopwarden.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "loopwarden.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable for the life of the release (a StatefulSet's selector is immutable). */}}
{{- define "loopwarden.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loopwarden.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "loopwarden.labels" -}}
helm.sh/chart: {{ include "loopwarden.chart" . }}
{{ include "loopwarden.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: loopwarden
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "loopwarden.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "loopwarden.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loopwarden.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* Where things live in the worker container. */}}
{{- define "loopwarden.stateDir" -}}/var/lib/loopwarden/state{{- end }}
{{- define "loopwarden.policyDir" -}}/etc/loopwarden/policy{{- end }}
{{- define "loopwarden.policyFile" -}}{{ include "loopwarden.policyDir" . }}/policy.yaml{{- end }}

{{/*
The policy file's ConfigMap data (policy.yaml): policyFile as written, else the policy map as YAML. Shared by
the workers' ConfigMap and the policy-check hook's, so the hook checks exactly what the workers will load.
*/}}
{{- define "loopwarden.policyData" -}}
{{- if .Values.policyFile }}
policy.yaml: |
  {{- .Values.policyFile | nindent 2 }}
{{- else }}
policy.yaml: |
  {{- toYaml (.Values.policy | default dict) | nindent 2 }}
{{- end }}
{{- end }}
{{- define "loopwarden.kafkaTlsDir" -}}/etc/loopwarden/kafka-tls{{- end }}
{{- define "loopwarden.signingDir" -}}/etc/loopwarden/signing{{- end }}
{{- define "loopwarden.operatorsDir" -}}/etc/loopwarden/operators{{- end }}

{{/*
Settings that cannot work together fail the render, with the value to fix, instead of a worker that
refuses to start (stream_app/bus/kafka.py checks the same at run time).
*/}}
{{- define "loopwarden.validate" -}}
{{- $protocol := .Values.kafka.securityProtocol }}
{{- $sasl := hasPrefix "SASL_" $protocol }}
{{- $ssl := hasSuffix "SSL" $protocol }}
{{- if and $sasl (not .Values.kafka.sasl.mechanism) }}
{{- fail (printf "kafka.sasl.mechanism: required with kafka.securityProtocol=%s" $protocol) }}
{{- end }}
{{- if and $sasl (not .Values.kafka.sasl.existingSecret) }}
{{- fail (printf "kafka.sasl.existingSecret: required with kafka.securityProtocol=%s (a Secret with the user name and password)" $protocol) }}
{{- end }}
{{- if and (not $sasl) (or .Values.kafka.sasl.mechanism .Values.kafka.sasl.existingSecret) }}
{{- fail (printf "kafka.sasl.*: set, but kafka.securityProtocol is %s; use SASL_PLAINTEXT or SASL_SSL" $protocol) }}
{{- end }}
{{- if and (not $ssl) .Values.kafka.tls.existingSecret }}
{{- fail (printf "kafka.tls.existingSecret: set, but kafka.securityProtocol is %s; use SSL or SASL_SSL" $protocol) }}
{{- end }}
{{- if and .Values.kafka.tls.keyKey (not .Values.kafka.tls.certKey) }}
{{- fail "kafka.tls.keyKey: needs kafka.tls.certKey (the client certificate it belongs to)" }}
{{- end }}
{{- if and .Values.signing.allowUnsigned .Values.signing.existingSecret }}
{{- fail "signing.allowUnsigned: true, but signing.existingSecret is set; unset signing.allowUnsigned to sign with that key" }}
{{- end }}
{{- if gt (mul .Values.worker.heartbeatSeconds 3) (int64 .Values.worker.sessionTimeoutSeconds) }}
{{- fail "worker.heartbeatSeconds: must be at most a third of worker.sessionTimeoutSeconds" }}
{{- end }}
{{- end }}
