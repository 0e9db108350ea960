// Helpers shared by the libtrain test files.
#pragma once

#include <doctest/doctest.h>

#include <memory>
#include <random>

#include "slide/train/backend.h"

namespace slide::train::testing {

// A backend by name; the test fails if it is not built.
inline std::unique_ptr<Backend> must_make(const char* name) {
  auto r = make_backend(name);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return std::move(*r);
}

// The process's reference backend.
inline Backend& reference() {
  static std::unique_ptr<Backend> b = must_make("reference");
  return *b;
}

// f64 values uniform in [lo, hi) from a fixed seed.
inline Tensor random_f64(const Shape& s, uint64_t seed, double lo = -1, double hi = 1) {
  auto t = Tensor::empty(s, DType::kF64, cpu_allocator());
  REQUIRE(t.ok());
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  for (int64_t i = 0; i < t->numel(); ++i) t->data<double>()[i] = u(g);
  return *t;
}

inline double dot_f64(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.data<double>()[i] * b.data<double>()[i];
  return s;
}

}  // namespace slide::train::testing
