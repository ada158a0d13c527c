# The embedded worker (server/moe_ep.h, libmoe_ep.so; issue 16): the ELF
# contract of the library, the header as strict C11, and the toy MoE layer of
# python/examples/embedded_moe_layer.py in 2 and 4 Python processes on
# /usr/bin/python3 with Debian's python3-numpy, the group formed remotely by
# `moe-ep up --targets` and by the Python Group client.
if(NOT TARGET moe_ep)
  return()
endif()
add_test(NAME embedded_library_exports
  COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/embedded/check_library.sh $<TARGET_FILE:moe_ep>
          ${PROJECT_VERSION_MAJOR})
set_tests_properties(embedded_library_exports PROPERTIES LABELS embedded TIMEOUT 60)

add_executable(moe_ep_c11_smoke ${CMAKE_CURRENT_SOURCE_DIR}/embedded/c11_smoke.c)
target_link_libraries(moe_ep_c11_smoke PRIVATE moe_ep)
set_target_properties(moe_ep_c11_smoke PROPERTIES C_STANDARD 11 C_STANDARD_REQUIRED ON
  C_EXTENSIONS OFF BUILD_RPATH $<TARGET_FILE_DIR:moe_ep>)
target_compile_options(moe_ep_c11_smoke PRIVATE -Wall -Wextra -pedantic -Werror)
add_test(NAME embedded_c11_smoke COMMAND moe_ep_c11_smoke ${PROJECT_VERSION})
set_tests_properties(embedded_c11_smoke PROPERTIES LABELS embedded TIMEOUT 60)

# The GPU data calls (issue 16 item 3): the C API on device buffers, a CUDA
# graph of dispatch + combine (exits 77 = skipped, with the reason, without
# a CUDA device), and the Python layer with torch CUDA tensors
# (python/tests/test_engine_gpu.py; skips, with the reason, without torch, a
# GPU or enough GPUs). Both form the group with `moe-ep up --targets`.
if(TARGET moe_ep_kernels AND TARGET moe-ep)
  add_executable(moe_ep_engine_embedded ${CMAKE_CURRENT_SOURCE_DIR}/embedded/engine_embedded.cc)
  target_link_libraries(moe_ep_engine_embedded PRIVATE moe_ep CUDA::cudart)
  set_target_properties(moe_ep_engine_embedded PROPERTIES BUILD_RPATH $<TARGET_FILE_DIR:moe_ep>)
  if(TARGET moe_ep_integration_tests)  # CapabilityMatrixEngine runs it
    add_dependencies(moe_ep_integration_tests moe_ep_engine_embedded)
  endif()
  add_test(NAME embedded_gpu_c_api COMMAND moe_ep_engine_embedded $<TARGET_FILE:moe-ep>)
  set_tests_properties(embedded_gpu_c_api PROPERTIES LABELS "embedded;gpu" SKIP_RETURN_CODE 77
    TIMEOUT 300)
  # The same calls on the one-sided plane (issue 34 item 2).
  add_test(NAME embedded_gpu_c_api_onesided
    COMMAND moe_ep_engine_embedded $<TARGET_FILE:moe-ep> one-sided)
  set_tests_properties(embedded_gpu_c_api_onesided PROPERTIES LABELS "embedded;gpu"
    SKIP_RETURN_CODE 77 TIMEOUT 300)
  # Two ranks as two processes sharing the GPU (DESIGN §10's engine-path set-up).
  add_test(NAME embedded_gpu_c_api_onesided_2_ranks
    COMMAND moe_ep_engine_embedded $<TARGET_FILE:moe-ep> one-sided 2)
  set_tests_properties(embedded_gpu_c_api_onesided_2_ranks PROPERTIES LABELS "embedded;gpu"
    SKIP_RETURN_CODE 77 TIMEOUT 300)
  # Four ranks as processes sharing the GPU on the one-sided plane, and on
  # the gloo plane with host buffers (no GPU: runs in CI); the capability
  # matrix runs the same three columns (issue 34 item 2).
  add_test(NAME embedded_gpu_c_api_onesided_4_ranks
    COMMAND moe_ep_engine_embedded $<TARGET_FILE:moe-ep> one-sided 4)
  set_tests_properties(embedded_gpu_c_api_onesided_4_ranks PROPERTIES LABELS "embedded;gpu"
    SKIP_RETURN_CODE 77 TIMEOUT 300)
  add_test(NAME embedded_c_api_gloo_4_ranks
    COMMAND moe_ep_engine_embedded $<TARGET_FILE:moe-ep> gloo 4)
  set_tests_properties(embedded_c_api_gloo_4_ranks PROPERTIES LABELS embedded TIMEOUT 300)
  # Two ranks on the nccl plane, one GPU each (skips with fewer than two):
  # step 4b's refused dispatch (issue 30 item 1).
  add_test(NAME embedded_gpu_c_api_nccl_2_ranks
    COMMAND moe_ep_engine_embedded $<TARGET_FILE:moe-ep> nccl 2)
  set_tests_properties(embedded_gpu_c_api_nccl_2_ranks PROPERTIES LABELS "embedded;gpu"
    SKIP_RETURN_CODE 77 TIMEOUT 300)
endif()
find_program(MOE_EP_GPU_PYTHON NAMES python3)
if(MOE_EP_GPU_PYTHON AND TARGET moe-ep)
  add_test(NAME embedded_python_engine_gpu
    COMMAND ${CMAKE_COMMAND} -E env MOE_EP_LIBRARY=$<TARGET_FILE:moe_ep>
            MOE_EP_CLI=$<TARGET_FILE:moe-ep> PYTHONPATH=${PROJECT_SOURCE_DIR}/python
            PYTHONDONTWRITEBYTECODE=1
            ${MOE_EP_GPU_PYTHON} -m unittest -v test_engine_gpu
    WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}/python/tests)
  set_tests_properties(embedded_python_engine_gpu PROPERTIES LABELS "embedded;gpu" TIMEOUT 600)
endif()

find_program(MOE_EP_SYSTEM_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(NOT MOE_EP_SYSTEM_PYTHON OR NOT TARGET moe_ep_python_stubs OR NOT TARGET moe-ep)
  message(STATUS "moe-ep: embedded Python tests off (need /usr/bin/python3, the stubs and moe-ep)")
  return()
endif()
execute_process(COMMAND ${MOE_EP_SYSTEM_PYTHON} -c "import numpy, grpc"
                RESULT_VARIABLE moe_ep_python_numpy OUTPUT_QUIET ERROR_QUIET)
if(NOT moe_ep_python_numpy EQUAL 0)
  message(STATUS "moe-ep: embedded Python tests off (/usr/bin/python3 lacks python3-numpy; "
                 "scripts/install-deps.sh installs it)")
  return()
endif()
set(moe_ep_embedded_env
  MOE_EP_LIBRARY=$<TARGET_FILE:moe_ep>
  PYTHONPATH=${PROJECT_BINARY_DIR}/python:${PROJECT_SOURCE_DIR}/python
  PYTHONDONTWRITEBYTECODE=1)
foreach(case "2;up" "4;group")
  list(GET case 0 ranks)
  list(GET case 1 former)
  add_test(NAME embedded_moe_layer_${ranks}_${former}
    COMMAND ${CMAKE_COMMAND} -E env ${moe_ep_embedded_env}
            ${MOE_EP_SYSTEM_PYTHON} ${PROJECT_SOURCE_DIR}/python/examples/embedded_moe_layer.py
            --ranks ${ranks} --former ${former} --moe-ep $<TARGET_FILE:moe-ep>)
  set_tests_properties(embedded_moe_layer_${ranks}_${former} PROPERTIES LABELS embedded
    TIMEOUT 300)
endforeach()
add_test(NAME embedded_python_engine
  COMMAND ${CMAKE_COMMAND} -E env ${moe_ep_embedded_env} MOE_EP_CLI=$<TARGET_FILE:moe-ep>
          ${MOE_EP_SYSTEM_PYTHON} -m unittest -v test_engine
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}/python/tests)
set_tests_properties(embedded_python_engine PROPERTIES LABELS embedded TIMEOUT 300)
# Issue 30: the DeepEP-shaped Buffer (python/moe_ep_client/deep_ep.py) with
# DeepEP's checks in 1, 2 and 4 rank processes, and the engines' first steps
# racing `moe-ep up --load-experts` / rank-by-rank LoadExperts, 100 runs.
add_test(NAME embedded_python_deep_ep
  COMMAND ${CMAKE_COMMAND} -E env ${moe_ep_embedded_env}
          ${MOE_EP_SYSTEM_PYTHON} -m unittest -v test_deep_ep
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}/python/tests)
set_tests_properties(embedded_python_deep_ep PROPERTIES LABELS embedded TIMEOUT 600)
# Issue 30 item 4: vLLM's FusedMoEPrepareAndFinalize and SGLang's DEEPEP_LL
# token dispatcher over that Buffer, with their documented call sequences.
add_test(NAME embedded_python_seams
  COMMAND ${CMAKE_COMMAND} -E env ${moe_ep_embedded_env}
          ${MOE_EP_SYSTEM_PYTHON} -m unittest -v test_seams
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}/python/tests)
set_tests_properties(embedded_python_seams PROPERTIES LABELS embedded TIMEOUT 600)
add_test(NAME embedded_python_engine_race
  COMMAND ${CMAKE_COMMAND} -E env ${moe_ep_embedded_env} MOE_EP_CLI=$<TARGET_FILE:moe-ep>
          ${MOE_EP_SYSTEM_PYTHON} -m unittest -v test_engine_race
  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}/python/tests)
# COST: the longest test (~200 s of 100 runs) starts first, so on a clean
# clone (no CTestCostData yet) it overlaps the rest instead of trailing them.
set_tests_properties(embedded_python_engine_race PROPERTIES LABELS embedded TIMEOUT 1500
                     COST 200)
