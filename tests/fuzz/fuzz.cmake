# The fuzz targets' list and the main build's side of them: the clang++ probe and the ctest entries.
# Included by tests/fuzz/CMakeLists.txt (the targets, in tests/sanitize's ASan build) and by
# tests/sanitize/CMakeLists.txt (the main build, which decides whether that ASan build holds them).

set(SLIDE_FUZZ_TARGETS
  fuzz_tile_record fuzz_slide_record fuzz_csv fuzz_file_stem fuzz_store_meta fuzz_store_mdb fuzz_manifest
  fuzz_safetensors fuzz_geojson fuzz_state_json fuzz_bag fuzz_sweep_grid)

# slide_fuzz_probe(<out_var>): sets <out_var> TRUE when SLIDE_FUZZ is not OFF and a clang++ whose
# libFuzzer links was found (SLIDE_FUZZ_CXX and SLIDE_FUZZ_CC, cache). Debian ships libFuzzer's
# runtime apart from clang (libclang-rt-N-dev), so the probe links a tiny target with
# -fsanitize=fuzzer,address,undefined. SLIDE_FUZZ=ON and no such compiler: a configure error.
function(slide_fuzz_probe out)
  set(${out} FALSE PARENT_SCOPE)
  if(SLIDE_FUZZ STREQUAL "OFF")
    message(STATUS "slidestream: fuzz targets off (SLIDE_FUZZ=OFF)")
    return()
  endif()
  find_program(SLIDE_FUZZ_CXX NAMES clang++ clang++-14 clang++-15 clang++-16)
  find_program(SLIDE_FUZZ_CC NAMES clang clang-14 clang-15 clang-16)
  set(ok FALSE)
  set(probe_err "no clang++ / clang on PATH")
  if(SLIDE_FUZZ_CXX AND SLIDE_FUZZ_CC)
    set(probe_dir "${CMAKE_CURRENT_BINARY_DIR}/fuzz-probe")
    file(MAKE_DIRECTORY "${probe_dir}")
    file(WRITE "${probe_dir}/probe.cpp"
      "#include <cstddef>\n#include <cstdint>\nextern \"C\" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n")
    execute_process(COMMAND "${SLIDE_FUZZ_CXX}" -fsanitize=fuzzer,address,undefined probe.cpp -o probe
      WORKING_DIRECTORY "${probe_dir}" RESULT_VARIABLE probe_rc OUTPUT_QUIET ERROR_VARIABLE probe_err)
    if(probe_rc EQUAL 0)
      set(ok TRUE)
    endif()
  endif()
  if(NOT ok)
    if(SLIDE_FUZZ STREQUAL "ON")
      message(FATAL_ERROR "SLIDE_FUZZ=ON but no clang++ with libFuzzer (Debian: clang libclang-rt-14-dev): "
        "${SLIDE_FUZZ_CXX} ${probe_err}")
    endif()
    message(STATUS "slidestream: fuzz targets off (no clang++ with libFuzzer; Debian: clang libclang-rt-14-dev)")
    return()
  endif()
  message(STATUS "slidestream: fuzz targets on (${SLIDE_FUZZ_CXX}, in tests/sanitize's ASan build)")
  set(${out} TRUE PARENT_SCOPE)
endfunction()

set(SLIDE_FUZZ_SECONDS 4 CACHE STRING "Seconds of fuzzing per target in each ctest entry (label fuzz)")

# slide_fuzz_add_tests(<bin_dir>): one ctest entry per target built in <bin_dir> (label fuzz):
# every file of regressions/<target>/ replayed, then SLIDE_FUZZ_SECONDS of fuzzing from
# corpus/<target>/ (run_target.sh). Inputs found and crashes go under build/tests/fuzz/work/, where
# scripts/fuzz.sh keeps them too. fuzz_store_mdb and fuzz_bag are left out: they stop at LMDB's and
# HDF5's own crashes on corrupt files (see their header comments); scripts/fuzz.sh runs them when
# named.
function(slide_fuzz_add_tests bin_dir)
  set(targets ${SLIDE_FUZZ_TARGETS})
  list(REMOVE_ITEM targets fuzz_store_mdb fuzz_bag)
  foreach(t IN LISTS targets)
    add_test(NAME ${t}
      COMMAND "${PROJECT_SOURCE_DIR}/tests/fuzz/run_target.sh" "${bin_dir}/${t}" "${SLIDE_FUZZ_SECONDS}"
              "${PROJECT_BINARY_DIR}/tests/fuzz/work")
    set_tests_properties(${t} PROPERTIES LABELS fuzz TIMEOUT 120 ENVIRONMENT SLIDE_FUZZ_SEED=1)
  endforeach()
endfunction()
