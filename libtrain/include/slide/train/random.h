// Random draws from a 64-bit engine (std::mt19937_64), computed as GCC's libstdc++ computes
// std::generate_canonical, std::uniform_real_distribution, std::bernoulli_distribution and
// std::normal_distribution (bits/random.tcc, bits/random.h of GCC 12), bit for bit.
//
// Why not the standard distributions themselves: libstdc++'s generate_canonical works out
// log2(engine range) with two long-double logarithms on every call. GCC folds them to a constant;
// clang cannot fold x86's 80-bit long double, so in a clang build (the AddressSanitizer build of
// tests/sanitize) every draw called logl twice: weight initialisation was 20% of libtrain's suite
// and 30% of slide-embed's run time there. These functions give the same values with the range's
// logarithm known at compile time. They also give the same values whatever the standard library
// (libc++'s distributions use other algorithms), so a seed means the same weights and the same
// augmentation draws wherever slidestream is built. tests/libtrain/test_random.cpp checks them
// against libstdc++'s distributions.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <type_traits>

namespace slide::train {

namespace detail {
// The engines these draws accept: unsigned 64-bit results over the whole range [0, 2^64 - 1], as
// std::mt19937_64's. Then generate_canonical's loop runs once for float and double (k =
// max(1, ceil(digits / 64)) = 1): one engine call per canonical value.
template <typename Engine>
constexpr bool kFull64BitEngine = std::is_same_v<typename Engine::result_type, uint64_t> && Engine::min() == 0 &&
                                  Engine::max() == std::numeric_limits<uint64_t>::max();
}  // namespace detail

/// A value in [0, 1) from one draw of `g`: std::generate_canonical<Real, digits>(g). The draw
/// converted to Real (round to nearest) and divided by 2^64; a draw that rounds up to 2^64 gives the
/// largest Real below 1. Real is float or double.
template <typename Real, typename Engine>
Real canonical(Engine& g) {
  static_assert(std::is_same_v<Real, float> || std::is_same_v<Real, double>, "canonical: float or double");
  static_assert(detail::kFull64BitEngine<Engine>, "canonical: an engine of 64-bit draws over [0, 2^64 - 1]");
  const Real r = static_cast<Real>(g()) / static_cast<Real>(18446744073709551616.0);  // / 2^64, exact
  return r < Real(1) ? r : std::nextafter(Real(1), Real(0));
}

/// std::uniform_real_distribution<Real>(lo, hi)(g): canonical * (hi - lo) + lo, in Real. In [lo,
/// hi) but for rounding (as the standard's).
template <typename Real, typename Engine>
Real uniform_real(Engine& g, Real lo, Real hi) {
  return canonical<Real>(g) * (hi - lo) + lo;
}

/// std::bernoulli_distribution(p)(g): true with probability p, from one canonical double.
template <typename Engine>
bool bernoulli(Engine& g, double p) {
  return canonical<double>(g) < p;
}

/// std::normal_distribution<double>(mean, stddev): Marsaglia's polar method (Knuth, TAOCP vol. 2,
/// 3.4.1 algorithm P), two canonical doubles per attempt, each accepted pair giving two values;
/// the second is kept for the next call, as the standard's distribution object keeps it. So one
/// sampler drawn n times gives what one std::normal_distribution object drawn n times gives.
class NormalSampler {
 public:
  NormalSampler(double mean, double stddev) : mean_(mean), stddev_(stddev) {}

  template <typename Engine>
  double operator()(Engine& g) {
    double v;
    if (saved_available_) {
      saved_available_ = false;
      v = saved_;
    } else {
      double x, y, r2;
      do {
        x = 2.0 * canonical<double>(g) - 1.0;
        y = 2.0 * canonical<double>(g) - 1.0;
        r2 = x * x + y * y;
      } while (r2 > 1.0 || r2 == 0.0);
      const double mult = std::sqrt(-2 * std::log(r2) / r2);
      saved_ = x * mult;
      saved_available_ = true;
      v = y * mult;
    }
    return v * stddev_ + mean_;
  }

 private:
  double mean_, stddev_;
  double saved_ = 0;
  bool saved_available_ = false;
};

}  // namespace slide::train
