// doctest's implementation, compiled once for every test executable (slide_doctest_impl in
// tests/CMakeLists.txt): each suite's own files only include <doctest/doctest.h>. The suites
// without a main of their own also link test_main.cpp (slide_doctest_main).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
