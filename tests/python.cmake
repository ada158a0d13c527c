# The Python client (python/moe_ep_client): its gRPC stubs are generated from
# proto/ at build time into BUILD/python (never committed; for PYTHONPATH use
# in a checkout), and ctest installs the package offline into a venv of
# /usr/bin/python3, the interpreter Debian's python3-grpcio and
# python3-protobuf serve (DESIGN §1), and runs its tests and example against
# real moe-ep-worker processes.
find_program(MOE_EP_SYSTEM_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
find_program(MOE_EP_GRPC_PYTHON_PLUGIN grpc_python_plugin)
if(NOT MOE_EP_SYSTEM_PYTHON OR NOT MOE_EP_GRPC_PYTHON_PLUGIN OR NOT TARGET moe-ep-worker)
  message(STATUS "moe-ep: Python client tests off (need /usr/bin/python3, grpc_python_plugin "
                 "and the worker)")
  return()
endif()
execute_process(COMMAND ${MOE_EP_SYSTEM_PYTHON} -c "import grpc, google.protobuf"
                RESULT_VARIABLE moe_ep_python_grpc OUTPUT_QUIET ERROR_QUIET)
if(NOT moe_ep_python_grpc EQUAL 0)
  message(STATUS "moe-ep: Python client tests off (/usr/bin/python3 lacks python3-grpcio or "
                 "python3-protobuf; scripts/install-deps.sh installs them)")
  return()
endif()
set(MOE_EP_PYTHON_OUT ${PROJECT_BINARY_DIR}/python)
file(GLOB moe_ep_protos CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/proto/moe_ep/v1/*.proto)
add_custom_command(
  OUTPUT ${MOE_EP_PYTHON_OUT}/moe_ep/v1/worker_pb2_grpc.py
  COMMAND ${CMAKE_COMMAND} -E env GRPC_PYTHON_PLUGIN=${MOE_EP_GRPC_PYTHON_PLUGIN}
          bash ${PROJECT_SOURCE_DIR}/python/generate_stubs.sh ${MOE_EP_PYTHON_OUT}
  DEPENDS ${moe_ep_protos} ${PROJECT_SOURCE_DIR}/python/generate_stubs.sh
  COMMENT "Generating the Python gRPC stubs of proto/moe_ep/v1")
add_custom_target(moe_ep_python_stubs ALL
  DEPENDS ${MOE_EP_PYTHON_OUT}/moe_ep/v1/worker_pb2_grpc.py)
# python/ installed offline into a fresh venv (pip install --no-build-isolation
# ./python, which generates the stubs), then python/tests run with that venv's
# interpreter against real workers (tests/python/install_offline.sh).
# With the moe-ep CLI, the model-config test also compares with its reader.
set(moe_ep_python_cli "")
if(TARGET moe-ep)
  set(moe_ep_python_cli $<TARGET_FILE:moe-ep>)
endif()
add_test(NAME python_client
  COMMAND ${PROJECT_SOURCE_DIR}/tests/python/install_offline.sh $<TARGET_FILE:moe-ep-worker>
          ${moe_ep_python_cli})
set_tests_properties(python_client PROPERTIES LABELS python TIMEOUT 180 COST 45)
