#!/usr/bin/env bash
# Proves that scripts/validate-deploy.sh rejects broken manifests: breaks a
# copy of deploy/k8s in many independent ways (numbered below), runs the validator once, and
# requires exit status 1 and one FAIL line naming each breakage.
# Usage: tests/deploy/validate_deploy_rejects.sh BUILD_DIR
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build_dir=${1:?usage: validate_deploy_rejects.sh BUILD_DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$root/deploy/k8s" "$work/k8s"
k=$work/k8s

# edit FILE OLD NEW: replace one exact line fragment, which must exist once.
edit() {
  local file=$k/$1
  local n
  n=$(OLD=$2 perl -0ne 'print scalar(() = /\Q$ENV{OLD}\E/g)' "$file")
  [ "$n" = 1 ] || { echo "test bug: '$2' occurs $n times in $1, expected once"; exit 1; }
  OLD=$2 NEW=$3 perl -0pi -e 's/\Q$ENV{OLD}\E/$ENV{NEW}/' "$file"
}

# 1. Kubernetes schema: wrong type.
edit base/statefulset.yaml 'replicas: 2  #' 'replicas: two  #'
# 2. unknown field in a built-in kind (a typo the API server drops or refuses).
edit base/service.yaml 'publishNotReadyAddresses: true' 'publishNotReadyAddress: true'
# 3. missing required field: a gRPC probe without its port.
edit base/statefulset.yaml '            grpc:
              port: 8081
              service: moe_ep.v1.Worker' '            grpc:
              service: moe_ep.v1.Worker'
# 4. LeaderWorkerSet schema: a value outside the enum, and an unknown field.
edit overlays/lws/leaderworkerset.yaml 'restartPolicy: RecreateGroupOnPodRestart' 'restartPolicy: Sometimes'
edit overlays/lws/leaderworkerset.yaml 'startupPolicy: LeaderCreated' 'startPolicy: LeaderCreated'
# 5. a worker flag the binary does not have.
edit overlays/cpu/worker-resources.yaml '--drain-timeout-ms=20000' '--drain-timeout=20000'
# 6. a moe-ep coordinator flag the binary does not have.
edit base/coordinator.yaml '--probe-timeout-ms=2000' '--probe-deadline-ms=2000'
# 7. an env variable nothing reads, and a script variable nothing defines.
edit overlays/lws/leaderworkerset.yaml '- name: MODEL' '- name: MODEL_NAME'
# 8. a readiness probe on a service the worker does not serve.
edit overlays/gpu-node/kustomization.yaml 'patches:' 'patches:
  - patch: |-
      - op: replace
        path: /spec/template/spec/containers/0/readinessProbe/grpc/service
        value: moe_ep.v1.Workers
    target:
      kind: StatefulSet'
# 9. DESIGN §12: NCCL on the host network without NCCL_HOSTID from the node.
edit overlays/gpu/worker-nccl.yaml 'fieldPath: spec.nodeName' 'fieldPath: metadata.name'
# 10. $(VAR) expansion of an env variable the container does not define.
edit overlays/cpu/worker-resources.yaml '--data-plane-host=$(POD_IP)' '--data-plane-host=$(POD_ADDR)'
# 11. LeaderWorkerSet pod template (checked as a Kubernetes PodTemplateSpec):
# wrong type, and an unknown field.
edit overlays/lws/leaderworkerset.yaml 'terminationGracePeriodSeconds: 30' 'terminationGracePeriodSeconds: thirty'
edit overlays/lws/leaderworkerset.yaml 'runAsGroup: 0' 'runAsGroups: 0'
# 12. a worker on a pod address in plaintext without --allow-insecure (it
# would exit at start-up).
edit overlays/cpu-insecure/worker-plaintext.yaml '            - --allow-insecure
' ''
# 13. a kubelet gRPC probe on a port other than the plaintext --health-listen
# port (the TLS port: the kubelet cannot do TLS).
edit base/statefulset.yaml '              port: 8081
              service: ""
            periodSeconds: 10' '              port: 50051
              service: ""
            periodSeconds: 10'
# 14. a startup probe on the group-following readiness name (issue 8: a pod
# not joined in time would be killed).
edit base/statefulset.yaml '              port: 8081
              service: ""
            periodSeconds: 2' '              port: 8081
              service: moe_ep.v1.Worker
            periodSeconds: 2'
# 15. an exec readiness probe that needs DNS and a valid certificate.
edit overlays/gpu/worker-remove-fixed-port.yaml 'moe-ep health --target "127.0.0.1:$((HEALTH_BASE_PORT + ${POD_INDEX:-${POD_NAME##*-}}))" --service moe_ep.v1.Worker' 'moe-ep status --targets "$POD_NAME.moe-ep-worker:$((BASE_PORT + ${POD_INDEX:-${POD_NAME##*-}}))"'
# 16. a readiness probe on the liveness name (passes before the worker joined).
edit overlays/lws/leaderworkerset.yaml ' --service moe_ep.v1.Worker' ''
# 17. the coordinator's readiness probe on the liveness name (it would pass
# while the group is down).
edit base/coordinator.yaml '              port: 8082
              service: moe_ep.v1.Coordinator' '              port: 8082
              service: ""'
# 18. a desired state the coordinator would refuse (a misspelt field).
edit overlays/gpu-node/coordinator-nccl.yaml '"procs_per_pod": 8' '"procs_per_node": 8'

# Issue 31 item 6: Pod Security "restricted", labels, the disruption budget,
# metrics and one group size.
# 19. a pod without seccompProfile RuntimeDefault.
edit base/statefulset.yaml '        seccompProfile:
          type: RuntimeDefault
      containers:' '      containers:'
# 20. a pod that mounts a service-account token.
edit base/coordinator.yaml 'automountServiceAccountToken: false' 'automountServiceAccountToken: true'
# 21. a container that may escalate privileges, and one that keeps
# capabilities (the LWS coordinator, the base coordinator).
edit overlays/lws/leaderworkerset.yaml '            securityContext:
              allowPrivilegeEscalation: false
              readOnlyRootFilesystem: true
              capabilities:
                drop: ["ALL"]
            # The coordinator' '            securityContext:
              readOnlyRootFilesystem: true
              capabilities:
                drop: ["ALL"]
            # The coordinator'
edit base/coordinator.yaml '              drop: ["ALL"]' '              drop: ["NET_RAW"]'
# 22. a pod that may run as root without the privileged exemption.
edit overlays/lws/leaderworkerset.yaml '          runAsNonRoot: true
          runAsUser: 65532' '          runAsUser: 65532'
# 23. host network and IPC_LOCK as root without the exemption (gpu), and the
# exemption on a pod that does not need it (cpu-insecure).
edit overlays/gpu/worker-nccl.yaml '        moe-ep/pod-security: privileged
' ''
edit overlays/cpu-insecure/worker-plaintext.yaml '  template:
    spec:' '  template:
    metadata:
      annotations:
        moe-ep/pod-security: privileged
    spec:'
# 24. no app.kubernetes.io/instance (the LWS render loses its labels entry),
# and selectors without it (the base's labels skip the selectors).
edit overlays/lws/kustomization.yaml '      app.kubernetes.io/instance: moe-ep' '      app.kubernetes.io/part-of: moe-ep'
edit base/kustomization.yaml 'includeSelectors: true' 'includeSelectors: false'
# 25. no PodDisruptionBudget for the workers (gpu-node deletes it).
edit overlays/gpu-node/kustomization.yaml '  - path: coordinator-nccl.yaml
' '  - path: coordinator-nccl.yaml
  - patch: |-
      $patch: delete
      apiVersion: policy/v1
      kind: PodDisruptionBudget
      metadata:
        name: moe-ep-worker
'
# 26. a worker without --metrics-listen, and a metrics port that is not named
# metrics (cpu-insecure, base).
edit overlays/cpu-insecure/worker-plaintext.yaml '            - --metrics-listen=0.0.0.0:9090
' ''
edit base/statefulset.yaml '            - name: metrics
              containerPort: 9090' '            - name: prom
              containerPort: 9090'
# 27. Prometheus annotations on a host-network pod (gpu keeps the base's port).
edit overlays/gpu/worker-nccl.yaml '        prometheus.io/port: null
' ''
# 28. the desired state's replicas not derived: the replacement of gpu and
# gpu-node selects no ConfigMap, so gpu keeps its "0" and gpu-node a
# hand-written 3.
edit overlays/gpu/kustomization.yaml '          name: moe-ep-desired-state' '          name: moe-ep-no-such-state'
edit overlays/gpu-node/kustomization.yaml '          name: moe-ep-desired-state' '          name: moe-ep-no-such-state'
edit overlays/gpu-node/coordinator-nccl.yaml '"replicas": "0"' '"replicas": "3"'
# 29. the LWS group size restated in an env variable.
edit overlays/lws/leaderworkerset.yaml '                value: "50051"  # = the workers'"'"' BASE_PORT below' '                value: "50051"  # = the workers'"'"' BASE_PORT below
              - name: GROUP_SIZE
                value: "2"'
# 30. an LWS coordinator whose targets do not come from LWS_LEADER_ADDRESS.
edit overlays/lws/leaderworkerset.yaml 'leader="${LWS_LEADER_ADDRESS%%.*}"   # <set>-<g>' 'leader="moe-ep-$GROUP_INDEX"'
edit overlays/lws/leaderworkerset.yaml 'domain="${LWS_LEADER_ADDRESS#*.}"    # <set>.<namespace>' 'domain="moe-ep"'

# 14. a worker flag in the underscore spelling of earlier releases (still
# accepted by the worker for one release, but the manifests are kebab-case).
edit overlays/gpu/worker-nccl.yaml '--drain-timeout-ms=20000 --log-level=info' '--drain-timeout-ms=20000 --log_level=info'

set +e
out=$("$root/scripts/validate-deploy.sh" --k8s-dir "$k" "$build_dir" 2>&1)
rc=$?
set -e
echo "$out"
fails=0
expect() {
  if grep -qF -- "$1" <<<"$out"; then
    echo "ok: rejected ($2)"
  else
    echo "MISSING: no FAIL line with '$1' ($2)"; fails=$((fails + 1))
  fi
}
expect 'StatefulSet/moe-ep-worker: /spec/replicas must be integer' 'wrong type'
expect "'\"publishNotReadyAddress\"' does not exist in type 'Service" 'unknown field'
expect "/spec/template/spec/containers/0/readinessProbe/grpc must have required property port" 'missing required field'
expect '/spec/leaderWorkerTemplate/restartPolicy: must be equal to one of the allowed values' 'LWS enum'
expect 'LeaderWorkerSet/moe-ep: /spec: unknown field "startPolicy"' 'LWS unknown field'
expect 'flag --drain-timeout of moe-ep-worker is not in `moe-ep-worker --help`' 'worker flag'
expect 'flag --probe-deadline-ms of moe-ep is not in `moe-ep coordinator --help`' 'moe-ep flag'
expect 'env MODEL_NAME is read by nothing' 'unused env'
expect 'the shell script reads MODEL, which is neither an env variable nor assigned' 'undefined script variable'
expect 'readinessProbe.grpc.service "moe_ep.v1.Workers" is not "" nor a service of proto/' 'probe service'
expect 'NCCL worker on the host network without NCCL_HOSTID from spec.nodeName' 'DESIGN §12'
expect '$(POD_ADDR) is not an env variable of the container' 'unresolved $(VAR)'
expect 'LeaderWorkerSet/moe-ep: /spec/leaderWorkerTemplate/workerTemplate/spec/terminationGracePeriodSeconds: must be integer' 'LWS pod template type'
expect "LeaderWorkerSet/moe-ep: /spec/leaderWorkerTemplate/workerTemplate: unknown field: Object literal may only specify known properties, and '\"runAsGroups\"' does not exist in type 'PodSecurityContext'" 'LWS pod template unknown field'
expect 'moe-ep-worker listens on 0.0.0.0:50051 in plaintext without --allow-insecure' 'plaintext without --allow-insecure'
expect 'flag --log_level of moe-ep-worker is a deprecated spelling: use --log-level' 'underscore spelling'
expect 'livenessProbe.grpc.port 50051 is not the worker'"'"'s --health-listen port 8081' 'probe not on the health port'
expect 'startupProbe asks "moe_ep.v1.Worker", which follows the group' 'startup probe on the readiness name'
expect 'readinessProbe calls `moe-ep status`, which depends on DNS' 'exec probe through DNS and TLS'
expect 'readinessProbe asks "", which does not follow the group: ask "moe_ep.v1.Worker"' 'readiness probe on the liveness name'
expect 'readinessProbe asks "", which does not follow the group: ask "moe_ep.v1.Coordinator"' 'coordinator readiness probe on the liveness name'
expect 'ConfigMap/moe-ep-desired-state: data/desired-state.json: `moe-ep coordinator --check` rejects it' 'desired state'
expect 'base.yaml: StatefulSet/moe-ep-worker: spec.template.spec: no seccompProfile RuntimeDefault' 'no seccomp profile'
expect 'base.yaml: Deployment/moe-ep-coordinator: spec.template.spec: automountServiceAccountToken is not false' 'service-account token'
expect 'containers[coordinator]: securityContext.allowPrivilegeEscalation is not false' 'privilege escalation'
expect 'Deployment/moe-ep-coordinator: spec.template.spec.containers[coordinator]: securityContext.capabilities.drop does not list ALL' 'capabilities kept'
expect 'LeaderWorkerSet/moe-ep: spec.leaderWorkerTemplate.leaderTemplate.spec: not Pod Security "restricted": coordinator without runAsNonRoot' 'root allowed'
expect 'gpu.yaml: StatefulSet/moe-ep-worker: spec.template.spec: not Pod Security "restricted": hostNetwork; hostIPC' 'privileged pod without the exemption'
expect 'cpu-insecure.yaml: StatefulSet/moe-ep-worker: spec.template.spec: annotated moe-ep/pod-security: privileged but meets "restricted"' 'needless exemption'
expect 'lws.yaml: LeaderWorkerSet/moe-ep: metadata.labels has no app.kubernetes.io/instance' 'instance label'
expect 'lws.yaml: PodDisruptionBudget/moe-ep-worker: metadata.labels has no app.kubernetes.io/instance' 'instance label (PDB)'
expect 'base.yaml: Service/moe-ep-worker: spec.selector does not select app.kubernetes.io/instance=moe-ep' 'selector without instance'
expect 'base.yaml: PodDisruptionBudget/moe-ep-worker: spec.selector.matchLabels does not select app.kubernetes.io/instance=moe-ep' 'PDB selector without instance'
expect 'cpu-insecure.yaml: StatefulSet/moe-ep-worker: spec.template.spec.containers[worker]: moe-ep-worker without --metrics-listen' 'no --metrics-listen'
expect 'base.yaml: StatefulSet/moe-ep-worker: spec.template.spec.containers[worker]: moe-ep-worker serves /metrics on 9090, which is no declared containerPort named metrics*' 'metrics port not named'
expect 'gpu.yaml: StatefulSet/moe-ep-worker: spec.template.spec: annotation prometheus.io/port on a host-network pod' 'scrape annotation under host network'
expect 'gpu.yaml: ConfigMap/moe-ep-desired-state: data/desired-state.json: headless_service.replicas "0" is not StatefulSet/moe-ep-worker'"'"'s spec.replicas' 'replicas not derived'
expect 'gpu.yaml: ConfigMap/moe-ep-desired-state: data/desired-state.json: `moe-ep coordinator --check` rejects it: moe-ep: error: INVALID_ARGUMENT: headless_service.replicas: expected >= 1, got 0' 'replicas left 0'
expect 'gpu-node.yaml: ConfigMap/moe-ep-desired-state: data/desired-state.json: headless_service.replicas "3" is not StatefulSet/moe-ep-worker'"'"'s spec.replicas 2' 'replicas by hand'
expect 'containers[coordinator]: env GROUP_SIZE restates the group size' 'LWS group size restated'
expect 'containers[coordinator]: the coordinator'"'"'s targets do not come from LWS_LEADER_ADDRESS' 'LWS targets not from the leader address'
expect 'gpu-node.yaml: StatefulSet/moe-ep-worker: spec.template: no PodDisruptionBudget selects these worker pods' 'no PodDisruptionBudget'
if [ "$rc" -ne 1 ]; then echo "validate-deploy.sh exited $rc, expected 1"; fails=$((fails + 1)); fi
if [ "$fails" -ne 0 ]; then echo "$fails expectations failed"; exit 1; fi
echo "all breakages rejected"
