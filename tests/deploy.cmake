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
# The images' default command (ENTRYPOINT + CMD of deploy/Dockerfile*) starts,
# serves health and the control plane, and stops on SIGTERM: run on the built
# binary in a network namespace of its own (tests/deploy/image_default_command.py),
# with /usr/bin/python3 and Debian's python3-grpcio for the health Check.
find_program(MOE_EP_SYSTEM_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(TARGET moe-ep-worker AND TARGET moe-ep AND MOE_EP_SYSTEM_PYTHON)
  foreach(image Dockerfile Dockerfile.gpu)
    string(REPLACE "." "_" test_name "image_default_command_${image}")
    add_test(NAME ${test_name}
      COMMAND ${MOE_EP_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/tests/deploy/image_default_command.py
              ${PROJECT_SOURCE_DIR}/deploy/${image} ${PROJECT_BINARY_DIR})
    set_tests_properties(${test_name} PROPERTIES LABELS deploy TIMEOUT 120 SKIP_RETURN_CODE 77)
  endforeach()
endif()
