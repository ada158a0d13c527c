# bench/plot_results.py (ctest -L bench): draws a small CSV fixture as a PNG
# and refuses a CSV without the benchmark columns; draws a floor call's
# phases over their floors (bench/floor_table.py, fixture/floors). Runs with /usr/bin/python3,
# whose matplotlib is Debian's python3-matplotlib (scripts/install-deps.sh);
# without it the test is skipped with the reason (exit 77).
find_program(MOE_EP_PLOT_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(NOT MOE_EP_PLOT_PYTHON)
  message(STATUS "moe-ep: bench_plot test off (no /usr/bin/python3)")
  return()
endif()
add_test(NAME bench_plot
  COMMAND ${CMAKE_COMMAND} -E env PYTHONDONTWRITEBYTECODE=1
          ${MOE_EP_PLOT_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/bench/plot_results_test.py
          ${PROJECT_SOURCE_DIR}/bench/plot_results.py ${CMAKE_CURRENT_SOURCE_DIR}/bench/fixture
          ${CMAKE_CURRENT_BINARY_DIR}/bench_plot)
set_tests_properties(bench_plot PROPERTIES LABELS bench TIMEOUT 120 SKIP_RETURN_CODE 77)
