# Checks of the repository's scripts (ctest -L lint): scripts/lint.sh's
# clang-tidy cache on a small project of its own (tests/scripts/
# lint_tidy_cache_test.py; real clang-format, g++ -MM and clang-tidy-14,
# skipped with exit 77 when one is missing).
find_program(MOE_EP_SYSTEM_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(MOE_EP_SYSTEM_PYTHON)
  add_test(NAME lint_tidy_cache
    COMMAND ${MOE_EP_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/scripts/lint_tidy_cache_test.py)
  set_tests_properties(lint_tidy_cache PROPERTIES LABELS lint TIMEOUT 120 SKIP_RETURN_CODE 77)
endif()
# Every kernel file has a module anchor that the step-path preload lists
# (tests/scripts/kernel_anchors_test.py; kernels/kernel_preload.h).
if(MOE_EP_SYSTEM_PYTHON)
  add_test(NAME kernel_anchors
    COMMAND ${MOE_EP_SYSTEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/scripts/kernel_anchors_test.py)
  set_tests_properties(kernel_anchors PROPERTIES TIMEOUT 30)
endif()
