// Half precision (mixed precision's storage, issue 11): the f16 and bf16 conversions of
// kernels/formulas.h (which the cuda backend's cast kernel compiles too) against the x86 F16C
// instruction (round to nearest even, where the CPU has it), a distance-based oracle for bf16,
// exhaustive round trips, and the edge cases PyTorch's .half() / .bfloat16() define; then the
// `cast` op on every host backend and the safetensors F16 / BF16 dtypes.
#include <doctest/doctest.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <random>
#include <vector>

#include "../../libtrain/src/kernels/formulas.h"
#include "slide/core/file.h"
#include "slide/train/backend.h"
#include "slide/train/checkpoint.h"
#include "test_util.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_half {

using namespace slide::train;
namespace fm = slide::train::formulas;

namespace {

#if defined(__x86_64__)
__attribute__((target("f16c"))) uint16_t hardware_f16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
bool have_f16c() {  // CPUID leaf 1, ECX bit 29 (<cpuid.h>; clang 14 has no "f16c" for __builtin_cpu_supports)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#else
uint16_t hardware_f16(float) { return 0; }
bool have_f16c() { return false; }
#endif

bool f16_is_nan(uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0; }

// The bf16 nearest to f by distance (ties: the even mantissa), computed without the bit trick.
uint16_t nearest_bf16(float f) {
  const uint32_t x = fm::float_bits(f);
  const uint32_t lo = x & 0xFFFF0000u, hi = lo + 0x10000u;  // |lo| <= |f| < |hi|, same sign
  const double d_lo = std::abs(static_cast<double>(f) - static_cast<double>(fm::bits_float(lo)));
  const double d_hi = std::abs(static_cast<double>(fm::bits_float(hi)) - static_cast<double>(f));
  if (d_lo < d_hi) return static_cast<uint16_t>(lo >> 16);
  if (d_hi < d_lo) return static_cast<uint16_t>(hi >> 16);
  return static_cast<uint16_t>(((lo >> 16) & 1u) == 0 ? lo >> 16 : hi >> 16);
}

std::vector<float> probe_floats() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.0f, 65520.0f, 65536.0f, 1e-8f, 6e-8f, 3e-8f,
                          std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()};
  std::mt19937 g(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 1000000; ++i) {
    const float f = fm::bits_float(bits(g));
    if (!std::isnan(f)) v.push_back(f);
  }
  // Every f16 value and the midpoints between neighbours (the ties).
  for (uint32_t h = 0; h < 0x7C00u; ++h) {
    const float a = fm::f16_to_f32(static_cast<uint16_t>(h)), b = fm::f16_to_f32(static_cast<uint16_t>(h + 1));
    v.push_back(a), v.push_back(-a), v.push_back(static_cast<float>((static_cast<double>(a) + b) / 2));
  }
  return v;
}

}  // namespace

TEST_CASE("half: f32 -> f16 rounds to nearest even, as F16C and PyTorch; f16 -> f32 is exact") {
  CHECK(fm::f32_to_f16(1.0f) == 0x3C00);
  CHECK(fm::f32_to_f16(-0.0f) == 0x8000);
  CHECK(fm::f32_to_f16(65504.0f) == 0x7BFF);  // the largest f16
  CHECK(fm::f32_to_f16(65519.0f) == 0x7BFF);  // below the midpoint to 65536
  CHECK(fm::f32_to_f16(65520.0f) == 0x7C00);  // the midpoint rounds to even: inf
  CHECK(fm::f32_to_f16(std::ldexp(1.0f, -24)) == 0x0001);      // the smallest subnormal
  CHECK(fm::f32_to_f16(std::ldexp(1.0f, -25)) == 0x0000);      // half of it: ties to even (0)
  CHECK(fm::f32_to_f16(3 * std::ldexp(1.0f, -25)) == 0x0002);  // 1.5 steps: ties to even (2)
  CHECK(fm::f32_to_f16(std::numeric_limits<float>::quiet_NaN()) == 0x7E00);
  CHECK(fm::f32_to_f16(-std::numeric_limits<float>::infinity()) == 0xFC00);
  // Every f16 pattern survives f16 -> f32 -> f16; NaNs stay NaN.
  for (uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const uint16_t back = fm::f32_to_f16(fm::f16_to_f32(static_cast<uint16_t>(h)));
    if (f16_is_nan(static_cast<uint16_t>(h))) {
      REQUIRE(f16_is_nan(back));
    } else {
      REQUIRE(back == h);
    }
  }
  CHECK(fm::f16_to_f32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(fm::f16_to_f32(0x7BFF) == 65504.0f);
  if (!have_f16c()) {
    MESSAGE("this CPU has no F16C: the hardware comparison is skipped");
    return;
  }
  const std::vector<float> fs = probe_floats();
  int64_t mismatches = 0;
  for (float f : fs) mismatches += fm::f32_to_f16(f) != hardware_f16(f);
  CHECK(mismatches == 0);
  MESSAGE(fs.size(), " floats converted as F16C does");
}

TEST_CASE("half: f32 -> bf16 rounds to nearest even; bf16 -> f32 is exact") {
  CHECK(fm::f32_to_bf16(1.0f) == 0x3F80);
  CHECK(fm::f32_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3F80);      // a tie: to even
  CHECK(fm::f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3F82);  // a tie: to even
  CHECK(fm::f32_to_bf16(std::numeric_limits<float>::max()) == 0x7F80);  // rounds to inf, as PyTorch
  CHECK((fm::f32_to_bf16(std::numeric_limits<float>::quiet_NaN()) & 0x7FC0) == 0x7FC0);
  CHECK(std::isnan(fm::bf16_to_f32(fm::f32_to_bf16(-std::numeric_limits<float>::quiet_NaN()))));
  for (uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const float f = fm::bf16_to_f32(static_cast<uint16_t>(b));
    if (!std::isnan(f)) REQUIRE(fm::f32_to_bf16(f) == b);
  }
  int64_t mismatches = 0;
  for (float f : probe_floats())
    if (std::isfinite(f) && std::abs(f) < 3.38e38f) mismatches += fm::f32_to_bf16(f) != nearest_bf16(f);
  CHECK(mismatches == 0);
}

TEST_CASE("cast op: f32 <-> f16 / bf16 on every host backend and the simulated device; checks") {
  const std::vector<float> values = {1.0f, -2.5f, 65520.0f, 1e-8f, 3.14159265f, -0.0f, 1e20f};
  for (const char* name : {"reference", "cpu", "reference-sim"}) {
    CAPTURE(name);
    auto be = make_backend(name);
    REQUIRE(be.ok());
    auto host = Tensor::empty({static_cast<int64_t>(values.size())}, DType::kF32, cpu_allocator());
    REQUIRE(host.ok());
    for (size_t i = 0; i < values.size(); ++i) host->data<float>()[i] = values[i];
    auto x = to_device(**be, *host);
    REQUIRE(x.ok());
    for (DType half : {DType::kF16, DType::kBF16}) {
      auto h = Tensor::empty(x->shape(), half, (*be)->allocator());
      auto back = Tensor::empty(x->shape(), DType::kF32, (*be)->allocator());
      REQUIRE(h.ok());
      REQUIRE(back.ok());
      REQUIRE((*be)->cast(*x, *h).ok());
      REQUIRE((*be)->cast(*h, *back).ok());
      auto hh = to_host(**be, *h);
      auto bb = to_host(**be, *back);
      REQUIRE(hh.ok());
      REQUIRE(bb.ok());
      for (size_t i = 0; i < values.size(); ++i) {
        const uint16_t want = half == DType::kF16 ? fm::f32_to_f16(values[i]) : fm::f32_to_bf16(values[i]);
        CHECK(hh->data<uint16_t>()[i] == want);
        const float round_trip = half == DType::kF16 ? fm::f16_to_f32(want) : fm::bf16_to_f32(want);
        CHECK(fm::float_bits(bb->data<float>()[i]) == fm::float_bits(round_trip));
      }
    }
    auto i32 = Tensor::empty(x->shape(), DType::kI32, (*be)->allocator());
    REQUIRE(i32.ok());
    CHECK((*be)->cast(*x, *i32).code() == slide::core::StatusCode::kUnimplemented);
    auto shorter = Tensor::empty({2}, DType::kF16, (*be)->allocator());
    REQUIRE(shorter.ok());
    CHECK((*be)->cast(*x, *shorter).code() == slide::core::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("safetensors: F16 and BF16 tensors round-trip; a half NaN is refused naming the element") {
  const testing::ScratchDir scratch("half_st");
  const std::string& dir = scratch.path();
  auto a = Tensor::empty({3}, DType::kF16, cpu_allocator());
  auto b = Tensor::empty({2}, DType::kBF16, cpu_allocator());
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  a->data<uint16_t>()[0] = fm::f32_to_f16(1.5f), a->data<uint16_t>()[1] = 0x8000, a->data<uint16_t>()[2] = 0x7BFF;
  b->data<uint16_t>()[0] = fm::f32_to_bf16(-3.0f), b->data<uint16_t>()[1] = 0x0001;
  REQUIRE(save_safetensors(dir + "/h.safetensors", {{"a", &*a}, {"b", &*b}}).ok());
  auto a2 = Tensor::zeros({3}, DType::kF16, cpu_allocator());
  auto b2 = Tensor::zeros({2}, DType::kBF16, cpu_allocator());
  REQUIRE(a2.ok());
  REQUIRE(b2.ok());
  REQUIRE(load_safetensors(dir + "/h.safetensors", {{"a", &*a2}, {"b", &*b2}}).ok());
  for (int i = 0; i < 3; ++i) CHECK(a2->data<uint16_t>()[i] == a->data<uint16_t>()[i]);
  for (int i = 0; i < 2; ++i) CHECK(b2->data<uint16_t>()[i] == b->data<uint16_t>()[i]);
  a->data<uint16_t>()[2] = 0x7E00;  // NaN
  REQUIRE(save_safetensors(dir + "/nan.safetensors", {{"a", &*a}}).ok());
  const Status s = load_safetensors(dir + "/nan.safetensors", {{"a", &*a2}});
  CHECK(s.code() == slide::core::StatusCode::kDataLoss);
  CHECK(s.to_string().find("holds NaN (element 2 of [3])") != std::string::npos);
}

TEST_CASE("safetensors: a header length whose low byte is 0x80 is not taken for a PyTorch pickle") {
  // The file starts with the header length, little-endian: a 640-byte header begins 80 02, as a
  // protocol-2 pickle does. Such files (about 1 in 32 headers) must load; a real pickle is refused.
  const testing::ScratchDir scratch("st_pickle_like");
  const std::string& dir = scratch.path();
  auto t = Tensor::zeros({2}, DType::kF32, cpu_allocator());
  REQUIRE(t.ok());
  int found = 0;
  for (size_t k = 1; k < 1200 && found < 2; ++k) {
    const std::string path = dir + "/t.safetensors", name(k, 'w');
    REQUIRE(save_safetensors(path, {{name, &*t}}).ok());
    auto bytes = slide::core::read_file(path);
    REQUIRE(bytes.ok());
    const auto b0 = static_cast<uint8_t>((*bytes)[0]), b1 = static_cast<uint8_t>((*bytes)[1]);
    if (b0 != 0x80 || b1 < 2 || b1 > 5) continue;
    ++found;
    CHECK_MESSAGE(load_safetensors(path, {{name, &*t}}).ok(), "header length byte 1 = " << int(b1));
    auto shapes = read_safetensors_shapes(path);
    REQUIRE_MESSAGE(shapes.ok(), shapes.status().to_string());
    CHECK(shapes->at(name) == Shape{2});
  }
  CHECK(found == 2);
  // A protocol-2 pickle is still refused, naming the converter.
  REQUIRE(slide::core::write_file_atomic(dir + "/p.pt", std::string("\x80\x02}q\x00(X\x01\x00\x00\x00", 12)).ok());
  const Status s = load_safetensors(dir + "/p.pt", {{"a", &*t}});
  CHECK(s.code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(s.message().find("convert_torchvision_weights.py") != std::string::npos);
  CHECK(read_safetensors_shapes(dir + "/p.pt").status().code() == slide::core::StatusCode::kInvalidArgument);
}

TEST_CASE("safetensors: shape entries that are not non-negative integers are data loss") {
  const testing::ScratchDir scratch("shapes_test");
  const std::string& dir = scratch.path();
  // 1e300 converted to int64 would be undefined behaviour.
  for (const std::string dim : {"1e300", "-3", "2.5", "\"4\"", "18446744073709551615"}) {
    const std::string header = "{\"w\":{\"dtype\":\"F32\",\"shape\":[" + dim + "],\"data_offsets\":[0,0]}}";
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
    REQUIRE(slide::core::write_file_atomic(dir + "/bad.safetensors", file + header).ok());
    const auto r = read_safetensors_shapes(dir + "/bad.safetensors");
    CHECK_MESSAGE(r.status().code() == slide::core::StatusCode::kDataLoss, dim);
    CHECK_MESSAGE(r.status().message().find("is not a non-negative integer") != std::string::npos, r.status().message());
  }
}

}  // namespace libtrain_test_half
