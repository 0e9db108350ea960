// The main of the doctest suites that have none of their own (slide_doctest_main in
// tests/CMakeLists.txt): doctest's command line (--test-case, --test-suite-exclude, ...), as
// DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN's would be; doctest's implementation is doctest_impl.cpp.
#include <doctest/doctest.h>

int main(int argc, char** argv) { return doctest::Context(argc, argv).run(); }
