# Deployment checks (ctest -L deploy): every kustomization under deploy/k8s
# renders and validates offline against the Kubernetes API schemas, the
# hand-written LeaderWorkerSet schema and the binaries' flags (scripts/validate-deploy.sh),
# and the validator rejects a deliberately broken copy of the manifests.
# Needs node + deploy/validate's npm packages (scripts/install-deploy-tools.sh)
# and kubectl with kustomize; a missing tool fails the test, it does not skip.
if(TARGET moe-ep-worker AND TARGET moe-ep)
  add_test(NAME deploy_manifests
    COMMAND ${PROJECT_SOURCE_DIR}/scripts/validate-deploy.sh ${PROJECT_BINARY_DIR})
  add_test(NAME deploy_manifests_reject_broken
    COMMAND ${PROJECT_SOURCE_DIR}/tests/deploy/validate_deploy_rejects.sh ${PROJECT_BINARY_DIR})
  set_tests_properties(deploy_manifests deploy_manifests_reject_broken
    PROPERTIES LABELS deploy TIMEOUT 120)
endif()
