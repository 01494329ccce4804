{{/* Names and labels. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Secrets: an existing Secret, or the one templates/secret.yaml creates. */}}
{{- define "pdserve.internalTokenSecret" -}}
{{- .Values.internalToken.existingSecret | default (printf "%s-internal-token" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{- define "pdserve.apiKeyEnabled" -}}
{{- if or .Values.apiKey.existingSecret .Values.apiKey.value -}}true{{- end -}}
{{- end -}}

{{- define "pdserve.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/*
A node group (role = prefill | decode) is `replicas` PP nodes of `pp` ranks each, spread over
pp / ranksPerPod pods. Pod names and DNS (headless service = "<fullname>-<role>"):
  StatefulSet mode: StatefulSet "<fullname>-<role>-<i>", node-rank r is pod "<fullname>-<role>-<i>-<r>"
  LWS mode:         LeaderWorkerSet "<fullname>-<role>", group i's leader (node-rank 0) is pod
                    "<fullname>-<role>-<i>", its workers "<fullname>-<role>-<i>-<r>"
*/}}
{{- define "pdserve.groupService" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .role -}}
{{- end -}}

{{- define "pdserve.podsPerNode" -}}
{{- $g := index .root.Values .role -}}
{{- if or (lt (int $g.ranksPerPod) 1) (ne (mod (int $g.pp) (int $g.ranksPerPod)) 0) -}}
{{- fail (printf "%s.pp (%v) must be a multiple of %s.ranksPerPod (%v)" .role $g.pp .role $g.ranksPerPod) -}}
{{- end -}}
{{- div (int $g.pp) (int $g.ranksPerPod) -}}
{{- end -}}

{{/* Host name of node-rank 0 (HTTP front, bootstrap server, PP rendezvous) of node .index. */}}
{{- define "pdserve.leaderHost" -}}
{{- $svc := include "pdserve.groupService" . -}}
{{- if .root.Values.lws.enabled -}}
{{- printf "%s-%d.%s" $svc (int .index) $svc -}}
{{- else -}}
{{- printf "%s-%d-0.%s" $svc (int .index) $svc -}}
{{- end -}}
{{- end -}}

{{/*
The pod template spec of a node group. Arguments: .root, .role, .index (node index, StatefulSet
mode), .leader: "true" (LWS leader, or an autoscaled StatefulSet's pod: a whole node), "false" (LWS
worker) or "auto" (StatefulSet: by NODE_RANK). With autoscaling.enabled a leader's front joins the
routers (the `register` sidecar) and leaves them before it drains (preStop): docs/DEPLOY.md.
*/}}
{{- define "pdserve.nodePodSpec" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $g := index $root.Values $role -}}
{{- $pods := int (include "pdserve.podsPerNode" .) -}}
{{- $svc := include "pdserve.groupService" . -}}
{{- $auto := $root.Values.autoscaling.enabled -}}
{{- $registers := and $auto (eq .leader "true") -}}
{{- $health := printf "[ \"$NODE_RANK\" != \"0\" ] || python -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:%d/health', timeout=4)\"" (int $g.port) -}}
{{- if $g.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{ include "pdserve.podCommon" $root }}
{{- if $auto }}
# preStop (node-rank 0) takes the node off the routers, then drains it: its requests get
# drain.graceSeconds, the streams left then move to another node; `register leave` holds at most
# that and 60 s (pdserve/launch.py LEAVE_MARGIN_S), and the pod is given 30 s more
terminationGracePeriodSeconds: {{ add (int $root.Values.drain.graceSeconds) 90 }}
{{- else }}
# SIGTERM drains the node (docs/RELIABILITY.md): its requests get drain.graceSeconds, the streams
# left then move to another node; the pod is given that and 30 s more before it is killed
terminationGracePeriodSeconds: {{ add (int $root.Values.drain.graceSeconds) 30 }}
{{- end }}
containers:
  - name: {{ $role }}
    image: {{ include "pdserve.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    # the command line is made by `pdserve launch` from the launch values (pdserve/launch.py),
    # as in docker-compose.yml and the multi-host tests; NODE_RANK below is the node-rank
    args:
      - pdserve
      - launch
      - {{ $role }}
      - --values
      - /etc/pdserve/values.json
      - --host
      - 0.0.0.0
      - --node-index
      - {{ .index | quote }}
    env:
      - name: NODE_RANK
        {{- if and $auto (not $root.Values.lws.enabled) }}
        value: "0"                # each pod of the autoscaled StatefulSet is a whole node
        {{- else }}
        valueFrom:
          fieldRef:
            {{- if $root.Values.lws.enabled }}
            fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']
            {{- else }}
            fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
            {{- end }}
        {{- end }}
      - name: POD_IP
        valueFrom:
          fieldRef:
            fieldPath: status.podIP
      - name: PDSERVE_ADVERTISE_HOST
        value: $(POD_IP)
      {{- if $registers }}
      {{- include "pdserve.workerUrlEnv" . | nindent 6 }}
      {{- end }}
      - name: PDSERVE_INTERNAL_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ include "pdserve.internalTokenSecret" $root }}
            key: {{ $root.Values.internalToken.key }}
      - name: PDSERVE_TRANSFER_PROTOCOL
        value: {{ $root.Values.transfer.protocol | quote }}
      {{- if $root.Values.transfer.device }}
      - name: PDSERVE_TRANSFER_DEVICE
        value: {{ $root.Values.transfer.device | quote }}
      {{- end }}
      - name: PDSERVE_LOG_LEVEL
        value: {{ $root.Values.logLevel | quote }}
      {{- with $g.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    ports:
      - name: http
        containerPort: {{ $g.port }}
      {{- if eq $role "prefill" }}
      - name: bootstrap
        containerPort: {{ $g.bootstrapPort }}
      {{- end }}
      - name: dist
        containerPort: {{ $g.distPort }}
    {{- if $registers }}
    # scale-down: off every router first (nothing new comes), then the drain (the rest finishes or
    # moves on mid-stream), held until the node has stopped (pdserve/register_cmd.py)
    lifecycle:
      preStop:
        exec:
          command: [pdserve, launch, {{ $role }}, --values, /etc/pdserve/values.json, --host, 127.0.0.1, --register, leave]
    {{- end }}
    {{- if or (eq .leader "true") (eq $pods 1) }}
    startupProbe:
      httpGet: {path: /health, port: http}
      {{- toYaml $root.Values.probes.startup | nindent 6 }}
    readinessProbe:
      httpGet: {path: /health, port: http}
      {{- toYaml $root.Values.probes.readiness | nindent 6 }}
    livenessProbe:
      httpGet: {path: /health, port: http}
      {{- toYaml $root.Values.probes.liveness | nindent 6 }}
    {{- else if eq .leader "auto" }}
    # One pod template for every node-rank: only node-rank 0 serves HTTP, the others pass.
    startupProbe:
      exec:
        command: [sh, -c, {{ $health | quote }}]
      {{- toYaml $root.Values.probes.startup | nindent 6 }}
    readinessProbe:
      exec:
        command: [sh, -c, {{ $health | quote }}]
      {{- toYaml $root.Values.probes.readiness | nindent 6 }}
    livenessProbe:
      exec:
        command: [sh, -c, {{ $health | quote }}]
      {{- toYaml $root.Values.probes.liveness | nindent 6 }}
    {{- end }}
    {{- $res := deepCopy ($g.resources | default dict) }}
    {{- if $g.rdma.enabled }}
    {{- $limits := get $res "limits" | default dict }}
    {{- $_ := set $limits $g.rdma.resourceName (int $g.rdma.count) }}
    {{- $_ := set $res "limits" $limits }}
    {{- end }}
    resources:
      {{- toYaml $res | nindent 6 }}
    {{- $sc := deepCopy $root.Values.containerSecurityContext }}
    {{- if $g.rdma.enabled }}
    {{- $caps := get $sc "capabilities" | default dict }}
    {{- $_ := set $caps "add" (list "IPC_LOCK") }}
    {{- $_ := set $sc "capabilities" $caps }}
    {{- end }}
    securityContext:
      {{- toYaml $sc | nindent 6 }}
    volumeMounts:
      {{- include "pdserve.scratchMounts" $root | nindent 6 }}
      - name: shm
        mountPath: /dev/shm
      {{- if ne $root.Values.model.source "image" }}
      - name: model
        mountPath: {{ $root.Values.model.mountPath }}
        readOnly: true
      {{- end }}
  {{- if $registers }}
  # registers the node's front with every router once it serves, and again wherever it is missing
  # (a router that restarted) every autoscaling.intervalSeconds
  - name: register
    image: {{ include "pdserve.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    args: [pdserve, launch, {{ $role }}, --values, /etc/pdserve/values.json, --host, 127.0.0.1, --register, join]
    env:
      - name: NODE_RANK
        value: "0"
      {{- include "pdserve.workerUrlEnv" . | nindent 6 }}
      - name: PDSERVE_INTERNAL_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ include "pdserve.internalTokenSecret" $root }}
            key: {{ $root.Values.internalToken.key }}
    resources:
      {{- toYaml $root.Values.autoscaling.registerResources | nindent 6 }}
    securityContext:
      {{- toYaml $root.Values.containerSecurityContext | nindent 6 }}
    volumeMounts:
      {{- include "pdserve.scratchMounts" $root | nindent 6 }}
  {{- end }}
volumes:
  {{- include "pdserve.scratchVolumes" $root | nindent 2 }}
  - name: shm
    emptyDir:
      medium: Memory
      {{- with $g.shmSize }}
      sizeLimit: {{ . }}
      {{- end }}
  {{- if eq $root.Values.model.source "pvc" }}
  - name: model
    persistentVolumeClaim:
      claimName: {{ required "model.pvc.claimName is required when model.source=pvc" $root.Values.model.pvc.claimName }}
      readOnly: true
  {{- else if eq $root.Values.model.source "hostPath" }}
  - name: model
    hostPath:
      path: {{ required "model.hostPath.path is required when model.source=hostPath" $root.Values.model.hostPath.path }}
      type: ""
  {{- end }}
{{- with $g.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The URL the routers know an autoscaled node by: its pod's name in the role's headless Service
(StatefulSet mode) or the LeaderWorkerSet's (`pdserve register`, PDSERVE_WORKER_URL). */}}
{{- define "pdserve.workerUrlEnv" -}}
{{- $g := index .root.Values .role -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: PDSERVE_WORKER_URL
  value: {{ printf "http://$(POD_NAME).%s:%d" (include "pdserve.groupService" .) (int $g.port) | quote }}
# the node's index in its role's set, which a scale-down stops from the top: the router's
# replicas gauge keeps a flipped node's index inside the count (router/routing/elastic.py)
- name: PDSERVE_REPLICA
  valueFrom:
    fieldRef:
      {{- if .root.Values.lws.enabled }}
      fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/group-index']
      {{- else }}
      fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
      {{- end }}
{{- end -}}

{{/* The routers' headless Service (every router pod, ready or not), where nodes register. */}}
{{- define "pdserve.routerPeers" -}}
{{- printf "%s-router-peers" (include "pdserve.fullname" .) -}}
{{- end -}}

{{/* The PromQL query of the nodes `role` needs (.root, .role): the router's gauge, the largest
over this release's routers (each one sees every node). */}}
{{- define "pdserve.replicasQuery" -}}
{{- $mine := printf "namespace=\"%s\",service=\"%s-router\"" .root.Release.Namespace (include "pdserve.fullname" .root) -}}
{{- $sel := .root.Values.autoscaling.prometheus.selector | default $mine -}}
{{- printf "max(pdserve_router_role_replicas_needed{role=\"%s\",%s})" .role $sel -}}
{{- end -}}

{{/* Scale-down of an autoscaled role: the highest wish of the window counts, then one node per
period at most (each drains first). Scale-up keeps the HPA's defaults. */}}
{{- define "pdserve.scaleDownBehavior" -}}
scaleDown:
  stabilizationWindowSeconds: {{ .Values.autoscaling.scaleDown.stabilizationWindowSeconds }}
  selectPolicy: Min
  policies:
    - type: Pods
      value: 1
      periodSeconds: {{ .Values.autoscaling.scaleDown.periodSeconds }}
{{- end -}}

{{/* The pods' service account. */}}
{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "pdserve.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* Pod annotations: pods restart when the Secrets the chart renders, or the launch values that
make their command lines, change. */}}
{{- define "pdserve.podAnnotations" -}}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
checksum/launch: {{ include "pdserve.launchValues" . | sha256sum }}
{{- end -}}

{{/*
The values `pdserve launch` makes every command line from (pdserve/launch.py): the keys it reads,
no secrets, and the host of each node's node-rank 0 as `leaders`. Mounted at /etc/pdserve.
*/}}
{{- define "pdserve.launchValues" -}}
{{- $leaders := dict -}}
{{- range $role := list "prefill" "decode" -}}
{{- $hosts := list -}}
{{- range $i := until (ternary 0 (int (index $.Values $role).replicas) $.Values.autoscaling.enabled) -}}
{{- $hosts = append $hosts (include "pdserve.leaderHost" (dict "root" $ "role" $role "index" $i)) -}}
{{- end -}}
{{- $_ := set $leaders $role $hosts -}}
{{- end -}}
{{- $v := dict "model" (dict "path" .Values.model.path) "lws" .Values.lws "drain" .Values.drain -}}
{{- $_ := set $v "router" (pick .Values.router "port" "policy" "extraArgs") -}}
{{- range $role := list "prefill" "decode" -}}
{{- $g := index $.Values $role -}}
{{- $_ := set $v $role (pick $g "replicas" "pp" "ranksPerPod" "port" "bootstrapPort" "distPort" "device" "threads" "extraArgs") -}}
{{- end -}}
{{- $_ := set $v "leaders" $leaders -}}
{{- if .Values.autoscaling.enabled -}}
{{- $startup := mul (int .Values.probes.startup.periodSeconds) (int .Values.probes.startup.failureThreshold) -}}
{{- $auto := dict "enabled" true "router" (include "pdserve.routerPeers" .) "intervalSeconds" .Values.autoscaling.intervalSeconds -}}
{{- $_ := set $auto "waitSeconds" (add $startup 60) -}}
{{- $_ := set $v "autoscaling" $auto -}}
{{- end -}}
{{- $v | toJson -}}
{{- end -}}

{{/* The pod-level settings every pdserve pod shares. */}}
{{- define "pdserve.podCommon" -}}
serviceAccountName: {{ include "pdserve.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* Writable paths under the read-only root filesystem, and the launch values (volumeMounts /
volumes). */}}
{{- define "pdserve.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/pdserve/.cache
- name: launch
  mountPath: /etc/pdserve
  readOnly: true
{{- end -}}
{{- define "pdserve.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
- name: launch
  configMap:
    name: {{ include "pdserve.fullname" . }}-launch
{{- end -}}
