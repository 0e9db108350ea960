# slide_tests_share_cores(): every ctest entry defined so far in the calling directory gets
# OMP_WAIT_POLICY=PASSIVE. The README's `ctest -j2` runs two entries at once on CI's two cores, and
# oneDNN's OpenMP threads (libgomp in the main build, libomp in the ASan build) spin at each
# barrier before sleeping, on a core the other entry needs: e2e_embed_TestEngine beside
# e2e_train_memory_TestPlan took 28.8 and 30.9 s with the default policy, 26.3 and 28.3 s with
# PASSIVE here (2026-11-29). Results are unchanged (waiting only). An entry's own OMP_WAIT_POLICY in
# its ENVIRONMENT would be overridden: none sets one.
function(slide_tests_share_cores)
  get_property(tests DIRECTORY PROPERTY TESTS)
  if(tests)
    set_tests_properties(${tests} PROPERTIES ENVIRONMENT_MODIFICATION "OMP_WAIT_POLICY=set:PASSIVE")
  endif()
endfunction()
