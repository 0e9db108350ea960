// Helpers shared by the libtrain test files.
#pragma once

#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "slide/train/backend.h"
#include "slide/train/random.h"

// OK(expr): the Status (or the Result's status) `expr` must be ok; the test stops with its message
// otherwise.
#define OK(expr)                                                                 \
  do {                                                                           \
    const ::slide::core::Status s_ = ::slide::train::testing::status_of(expr); \
    REQUIRE_MESSAGE(s_.ok(), s_.to_string());                                    \
  } while (0)

namespace slide::train::testing {

// A new directory "slide_<tag>_XXXXXX" under the system's temporary directory, removed with all it
// holds when the object goes. mkdtemp makes the name unique: the plain suite and the sanitizer
// builds' suites run the same cases at once under `ctest -j2`, and a fixed name would let one
// process's files (or its clean-up) meet the other's, or a killed run's leftovers the next run.
// Only the process that made it removes it: a forked child that exits normally (running static
// destructors, as tests/cache/test_bag.cpp's does) leaves its parent's directories alone.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag) : path_(make(tag)), owner_(::getpid()) {}
  ~ScratchDir() {
    if (::getpid() != owner_) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  // The path of `name` inside the directory.
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  static std::string make(const std::string& tag) {
    std::string dir = (std::filesystem::temp_directory_path() / ("slide_" + tag + "_XXXXXX")).string();
    REQUIRE_MESSAGE(mkdtemp(dir.data()) != nullptr, dir);
    return dir;
  }
  std::string path_;
  pid_t owner_;
};

inline slide::core::Status status_of(const slide::core::Status& s) { return s; }
template <typename T>
slide::core::Status status_of(const slide::core::Result<T>& r) {
  return r.status();
}

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
  for (int64_t i = 0; i < t->numel(); ++i) t->data<double>()[i] = slide::train::uniform_real(g, lo, hi);
  return *t;
}

inline double dot_f64(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.data<double>()[i] * b.data<double>()[i];
  return s;
}

// The largest error of `analytic` against the central difference (step h) of loss() over every
// element of the f64 `input`, normalised by max(1, |numeric|, |analytic|) (Caffe's gradient
// checker's scaling); *worst_index gets the element.
inline double gradient_error(Tensor& input, const Tensor& analytic, const std::function<double()>& loss,
                             double h = 1e-6, int64_t* worst_index = nullptr) {
  REQUIRE(analytic.shape() == input.shape());
  double worst = 0;
  for (int64_t i = 0; i < input.numel(); ++i) {
    double& v = input.data<double>()[i];
    const double saved = v;
    v = saved + h;
    const double up = loss();
    v = saved - h;
    const double down = loss();
    v = saved;
    const double numeric = (up - down) / (2 * h);
    const double a = analytic.data<double>()[i];
    const double err = std::abs(numeric - a) / std::max({1.0, std::abs(numeric), std::abs(a)});
    if (err > worst) {
      worst = err;
      if (worst_index != nullptr) *worst_index = i;
    }
  }
  return worst;
}

// Checks gradient_error(...) < tol.
inline void check_gradient(const std::string& what, Tensor& input, const Tensor& analytic,
                           const std::function<double()>& loss, double h = 1e-6, double tol = 1e-6) {
  int64_t worst_i = -1;
  const double worst = gradient_error(input, analytic, loss, h, &worst_i);
  CAPTURE(what);
  CAPTURE(worst_i);
  CHECK(worst < tol);
}

// A pair of tensors with the same values: f64 for the reference backend, f32 for cpu. With a
// seed, uniform in [lo, hi) and rounded to f32 first (both backends see the same input); with
// seed 0, every element is `fill`.
struct Pair {
  Tensor d, f;
};
inline Pair make_pair(const Shape& s, uint64_t seed = 0, double lo = -1, double hi = 1, double fill = 0) {
  Pair p{*Tensor::empty(s, DType::kF64, cpu_allocator()), *Tensor::empty(s, DType::kF32, cpu_allocator())};
  std::mt19937_64 g(seed);
  for (int64_t i = 0; i < p.d.numel(); ++i) {
    const double v = seed ? static_cast<float>(slide::train::uniform_real(g, lo, hi)) : fill;
    p.d.data<double>()[i] = v;
    p.f.data<float>()[i] = static_cast<float>(v);
  }
  return p;
}

// ggml's test-backend-ops check: NaN/Inf in the f32 result first, then the largest error against
// the f64 one normalised by max(1, the reference's magnitude), under `tol`.
inline void compare(const std::string& what, const Pair& p, double tol) {
  REQUIRE_MESSAGE(p.f.layout() == Layout::kPlain, what, ": the f32 result is in the ", layout_name(p.f.layout()),
                  " layout (compare its Backend::to_plain)");
  double scale = 1, worst = 0;
  for (int64_t i = 0; i < p.d.numel(); ++i) scale = std::max(scale, std::abs(p.d.data<double>()[i]));
  for (int64_t i = 0; i < p.d.numel(); ++i) {
    const float v = p.f.data<float>()[i];
    REQUIRE_MESSAGE(std::isfinite(v), what, ": element ", i, " is not finite");
    worst = std::max(worst, std::abs(double(v) - p.d.data<double>()[i]) / scale);
  }
  CAPTURE(what);
  CHECK(worst < tol);
}

// Half-precision storage (backend.h): `t` (host memory) converted to `dtype` by the reference
// backend's cast; a host tensor's values as f32 (f16 / bf16 widened exactly); the largest
// |got - want| over max(1, max |want|) (compare's normalisation; a non-finite value of got fails);
// and the half type's unit roundoff u (2^-11 for f16, 2^-8 for bf16), the bound of one rounding.
inline Tensor host_cast(const Tensor& t, DType dtype) {
  auto out = Tensor::empty(t.shape(), dtype, cpu_allocator(), "host cast");
  REQUIRE(out.ok());
  const Status s = reference().cast(t, *out);
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  return *out;
}
inline std::vector<float> host_values(const Tensor& t) {
  const Tensor f = t.dtype() == DType::kF32 ? t : host_cast(t, DType::kF32);
  return std::vector<float>(f.data<float>(), f.data<float>() + f.numel());
}
inline double normalised_error(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double scale = 1, worst = 0;
  for (float w : want) scale = std::max(scale, double(std::abs(w)));
  for (size_t i = 0; i < got.size(); ++i) {
    REQUIRE_MESSAGE(std::isfinite(got[i]), "element ", i, " is not finite");
    worst = std::max(worst, std::abs(double(got[i]) - double(want[i])) / scale);
  }
  return worst;
}
// f32 values uniform in [lo, hi) from a seed, in host memory.
inline Tensor random_f32(const Shape& s, uint64_t seed, double lo = -1, double hi = 1) {
  Tensor t = *Tensor::empty(s, DType::kF32, cpu_allocator());
  std::mt19937_64 g(seed);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(slide::train::uniform_real(g, lo, hi));
  return t;
}
// random_f32's values rounded to `half` and widened back: f32 values that the half type holds
// exactly, so an f32 op sees what the half op sees.
inline Tensor representable(const Shape& s, uint64_t seed, DType half, double lo = -1, double hi = 1) {
  return host_cast(host_cast(random_f32(s, seed, lo, hi), half), DType::kF32);
}
inline double unit_roundoff(DType half) { return half == DType::kF16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8); }

}  // namespace slide::train::testing
