{{- define "vllm-vcr.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vllm-vcr.fullname" -}}
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

{{- define "vllm-vcr.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "vllm-vcr.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* selector labels of one role: (dict "root" $ "role" "decode") */}}
{{- define "vllm-vcr.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-vcr.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{/* the engine type, checked: vllm or sglang */}}
{{- define "vllm-vcr.engineType" -}}
{{- if has .Values.engineType (list "vllm" "sglang") }}{{ .Values.engineType }}{{ else }}{{ fail (printf "engineType must be vllm or sglang, got %q" (toString .Values.engineType)) }}{{ end }}
{{- end }}

{{- define "vllm-vcr.image" -}}
{{ printf "%s:%s" .Values.image.repository (toString .Values.image.tag) }}
{{- end }}

{{/* the roles that run engines, in this mode */}}
{{- define "vllm-vcr.engineRoles" -}}
{{- if eq .Values.mode "aggregated" }}aggregated{{ else if eq .Values.mode "disaggregated" }}prefill decode{{ else }}{{ fail (printf "mode must be aggregated or disaggregated, got %q" .Values.mode) }}{{ end }}
{{- end }}

{{- define "vllm-vcr.replayConfigMap" -}}
{{- if .Values.replay.configMap.create }}{{ include "vllm-vcr.fullname" . }}-replay{{ else }}{{ .Values.replay.configMap.name }}{{ end }}
{{- end }}

{{/* the MOCK_* environment of one engine role: (dict "root" $ "role" "decode") */}}
{{- define "vllm-vcr.engineEnv" -}}
{{- $root := .root }}
{{- $role := index $root.Values.roles .role }}
{{- $e := merge (deepCopy (default dict $role.engine)) $root.Values.engine }}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: MODEL
  value: {{ $root.Values.model | quote }}
- name: VLLM_PORT
  value: {{ $role.port | quote }}
- name: MOCK_PD_ROLE
  value: {{ ternary "both" .role (eq .role "aggregated") | quote }}
- name: MOCK_ENGINE_TYPE
  value: {{ include "vllm-vcr.engineType" $root | quote }}
- name: MOCK_CONTROL_PORT
  {{- $controlPort := ternary $root.Values.fleet.controlBasePort $root.Values.control.port $root.Values.fleet.enabled }}
  value: {{ ternary (toString $controlPort) "off" $root.Values.control.enabled | quote }}
{{- if and $root.Values.control.enabled $root.Values.control.expose }}
- name: MOCK_CONTROL_HOST
  value: "0.0.0.0"
{{- end }}
{{- with $root.Values.control.token }}
{{- if and $root.Values.control.enabled .secretName }}
- name: MOCK_CONTROL_TOKEN
  valueFrom: {secretKeyRef: {name: {{ .secretName | quote }}, key: {{ default "token" .secretKey | quote }}}}
{{- end }}
{{- end }}
{{- range $env, $key := dict "MOCK_TTFT_MS" "timeToFirstTokenMs" "MOCK_TTFT_STDDEV_MS" "timeToFirstTokenStdDevMs" "MOCK_ITL_MS" "interTokenLatencyMs" "MOCK_ITL_STDDEV_MS" "interTokenLatencyStdDevMs" "MOCK_PREFILL_OVERHEAD_MS" "prefillOverheadMs" "MOCK_PREFILL_TIME_PER_TOKEN_MS" "prefillTimePerTokenMs" "MOCK_PREFILL_TIME_STDDEV_MS" "prefillTimeStdDevMs" "MOCK_TIME_FACTOR_UNDER_LOAD" "timeFactorUnderLoad" "MOCK_MAX_NUM_SEQS" "maxNumSeqs" "MOCK_MAX_NUM_BATCHED_TOKENS" "maxNumBatchedTokens" "MOCK_MAX_MODEL_LEN" "maxModelLen" "MOCK_LONG_PREFILL_TOKEN_THRESHOLD" "longPrefillTokenThreshold" "MOCK_SCHEDULING_POLICY" "schedulingPolicy" "MOCK_KV_CACHE_SIZE" "kvCacheSize" "MOCK_TOKENS_PER_BLOCK" "blockSize" "MOCK_FAILURE_INJECTION_RATE" "failureInjectionRate" "MOCK_FAILURE_TYPES" "failureTypes" "MOCK_SEED" "seed" "MOCK_TIME_SCALE" "timeScale" "MOCK_SHUTDOWN_TIMEOUT" "shutdownTimeoutSeconds" "MOCK_ENGINE_COUNT" "dataParallelSize" }}
- name: {{ $env }}
  value: {{ index $e $key | toString | quote }}
{{- end }}
- name: MOCK_LOG_REQUESTS
  value: {{ ternary "1" "0" (eq (toString $e.logRequests) "true") | quote }}
{{- if $e.extraArgs }}
- name: MOCK_EXTRA_ARGS
  value: {{ join " " $e.extraArgs | quote }}
{{- end }}
{{- if eq .role "prefill" }}
- name: MOCK_SIDE_CHANNEL_PORT
  value: {{ $role.sideChannelPort | quote }}
{{- end }}
{{- with $root.Values.kvEvents }}
{{- if .enabled }}
- name: MOCK_ENABLE_KV_EVENTS
  value: "1"
- name: MOCK_KV_EVENTS_ENDPOINT
  value: {{ .endpoint | quote }}
- name: MOCK_KV_EVENTS_TOPIC
  value: {{ default (printf "kv@$(POD_IP):%v@%s" $role.port $root.Values.model) .topic | quote }}
{{- end }}
{{- end }}
{{- with $root.Values.replay }}
{{- range $env, $key := dict "MOCK_RESPONSE_REPLAY_TRACE" "responseReplayTrace" "MOCK_LATENCY_TRACE" "latencyTrace" "MOCK_REPLAY_TOKENS" "replayTokens" "MOCK_REPLAY_STEPS" "replaySteps" }}
{{- if index $root.Values.replay $key }}
- name: {{ $env }}
  value: {{ printf "/etc/vllm-vcr/replay/%s" (index $root.Values.replay $key) | quote }}
{{- end }}
{{- end }}
- name: MOCK_REPLAY_MATCH
  value: {{ .replayMatch | quote }}
{{- end }}
{{- with $root.Values.fleet }}
{{- if .enabled }}
{{- if ne $root.Values.mode "aggregated" }}{{ fail "fleet.enabled needs mode: aggregated" }}{{ end }}
{{- if not .workersConfig }}
- name: MOCK_FLEET_WORKERS
  value: {{ .workers | toString | quote }}
{{- end }}
{{- if .processes }}
- name: MOCK_FLEET_PROCESSES
  value: {{ .processes | toString | quote }}
{{- end }}
{{- if .workersConfig }}
- name: MOCK_FLEET_CONFIG
  value: "/etc/vllm-vcr/fleet/workers.yaml"
{{- end }}
{{- end }}
{{- end }}
{{- with $role.env }}
{{ toYaml . }}
{{- end }}
{{- end }}
