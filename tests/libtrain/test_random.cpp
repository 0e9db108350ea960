// slide/train/random.h against libstdc++'s distributions: the same values bit for bit, from the same
// engine states (weight initialisation, dropout masks and augmentation draw through it, so a seed
// keeps meaning what it meant when they called the standard distributions).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "slide/train/random.h"

namespace libtrain_test_random {

using slide::train::bernoulli;
using slide::train::canonical;
using slide::train::NormalSampler;
using slide::train::uniform_real;

// An engine that returns the values it is given, then repeats the last: to reach draws that a
// real engine gives about once in 2^53 (those that round up to 2^64).
struct ScriptedEngine {
  using result_type = uint64_t;
  static constexpr result_type min() { return 0; }
  static constexpr result_type max() { return std::numeric_limits<uint64_t>::max(); }
  std::vector<uint64_t> values;
  size_t next = 0;
  result_type operator()() { return values[std::min(next++, values.size() - 1)]; }
};

#if defined(__GLIBCXX__)  // the oracle is libstdc++'s algorithm; other libraries draw otherwise

TEST_CASE("random: canonical, uniform, bernoulli and normal draws equal libstdc++'s bit for bit") {
  for (uint64_t seed : {0ull, 1ull, 11ull, 0x9E3779B97F4A7C15ull}) {
    CAPTURE(seed);
    std::mt19937_64 ours(seed), theirs(seed);
    std::uniform_real_distribution<double> ud(-0.125, 0.375);
    std::uniform_real_distribution<float> uf(0.6f, 1.4f);
    std::bernoulli_distribution keep(0.7);
    std::normal_distribution<double> normal(0.25, 0.0625);
    NormalSampler sampler(0.25, 0.0625);
    int mismatches = 0;
    // Interleaved, so that a sampler drawing more or fewer engine values than the standard's shows
    // in every later draw; an odd count of normal draws between the others, so that the kept
    // second value of the polar method's pair is used across them.
    for (int i = 0; i < 20000; ++i) {
      if (canonical<double>(ours) != std::generate_canonical<double, 53>(theirs)) ++mismatches;
      if (canonical<float>(ours) != std::generate_canonical<float, 24>(theirs)) ++mismatches;
      if (uniform_real(ours, -0.125, 0.375) != ud(theirs)) ++mismatches;
      if (uniform_real(ours, 0.6f, 1.4f) != uf(theirs)) ++mismatches;
      if (bernoulli(ours, 0.7) != keep(theirs)) ++mismatches;
      for (int k = 0; k < 3; ++k)
        if (sampler(ours) != normal(theirs)) ++mismatches;
    }
    CHECK(mismatches == 0);
    CHECK(ours() == theirs());  // the same number of engine draws in all
  }
}

TEST_CASE("random: a draw that rounds up to 2^64 gives the largest value below 1, as libstdc++'s") {
  // 2^64 - 1 rounds to 2^64 in float and in double; 2^64 - 2^11 is the largest double below it, and
  // 2^64 - 2^40 the largest float below it.
  for (uint64_t v : {~0ull, ~0ull - 1023, (~0ull << 11), (~0ull << 40), 0ull, 1ull}) {
    CAPTURE(v);
    ScriptedEngine a{{v}}, b{{v}};
    const double d = canonical<double>(a);
    CHECK(d == std::generate_canonical<double, 53>(b));
    CHECK(d < 1.0);
    ScriptedEngine c{{v}}, e{{v}};
    const float f = canonical<float>(c);
    CHECK(f == std::generate_canonical<float, 24>(e));
    CHECK(f < 1.0f);
  }
  ScriptedEngine top{{~0ull}};
  CHECK(canonical<double>(top) == std::nextafter(1.0, 0.0));
  CHECK(canonical<float>(top) == std::nextafter(1.0f, 0.0f));
  // The polar method's rejections: a pair outside the unit disc (x = y = 1 - 2^-53, r2 > 1), then
  // the origin (r2 == 0) are drawn again, as libstdc++ draws them.
  const uint64_t half = 1ull << 63;
  ScriptedEngine s{{~0ull, ~0ull, half, half, half + (1ull << 61), half - (1ull << 62)}};
  ScriptedEngine t = s;
  NormalSampler ours(0.0, 1.0);
  std::normal_distribution<double> theirs(0.0, 1.0);
  CHECK(ours(s) == theirs(t));
  CHECK(ours(s) == theirs(t));
  CHECK(s.next == 6);
  CHECK(t.next == 6);
}

#endif

TEST_CASE("random: the draws' ranges and moments") {
  // Whatever the standard library: canonical values in [0, 1), uniform ones in [lo, hi), a
  // Bernoulli's rate and a normal's mean and deviation near their parameters (n = 200000: the
  // bounds are over 10 standard errors wide).
  std::mt19937_64 g(5);
  const int n = 200000;
  double sum = 0, sum2 = 0, kept = 0;
  NormalSampler normal(3.0, 0.5);
  for (int i = 0; i < n; ++i) {
    const double c = canonical<double>(g);
    REQUIRE((c >= 0.0 && c < 1.0));
    const float u = uniform_real(g, -2.0f, -1.0f);
    REQUIRE((u >= -2.0f && u <= -1.0f));
    kept += bernoulli(g, 0.25) ? 1 : 0;
    const double v = normal(g);
    sum += v;
    sum2 += v * v;
  }
  const double mean = sum / n, var = sum2 / n - mean * mean;
  CHECK(std::abs(kept / n - 0.25) < 0.01);
  CHECK(std::abs(mean - 3.0) < 0.012);
  CHECK(std::abs(std::sqrt(var) - 0.5) < 0.01);
}

}  // namespace libtrain_test_random
