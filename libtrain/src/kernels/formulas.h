// The per-element formulas of the op list, written once for every backend.
//
// Each function here is the arithmetic of one element of an op in backend.h: the reference
// backend's loops call them (and through it the cpu backend, which delegates these ops to
// reference's loops), and the cuda backend's kernels call the very same functions, compiled by
// nvcc as __host__ __device__. So the CPU suite (test_reference_ops, test_optimizer, the golden
// step against PyTorch) exercises the code a GPU runs, as llm.c keeps train_gpt2.c and
// train_gpt2.cu name for name.
//
// Rules for this file: no state, no allocation, no library calls other than <cmath>'s exp, sqrt
// and pow (which CUDA provides in device code); T is the storage type (float or double), and the
// arithmetic is written exactly as the reference loops always did (double accumulation where they
// used it), so that moving a formula here never changes a bit on the CPU. On the GPU, nvcc fuses
// a * b + c into an FMA unless compiled with -fmad=false, so the cuda backend's results may differ
// from the CPU's in the last bit; its parity tests state that tolerance.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SLIDE_HD __host__ __device__ inline
#else
#define SLIDE_HD inline
#endif

namespace slide::train::formulas {

// --- Half precision (backend.h: cast) -------------------------------------------------------------
// IEEE 754 binary16 (f16: 1 sign, 5 exponent, 10 mantissa bits) and bfloat16 (bf16: the top 16
// bits of an f32), stored as their bit patterns (uint16_t). Conversions from f32 round to nearest,
// ties to even (what CUDA's __float2half_rn / __float2bfloat16_rn and PyTorch's .half() /
// .bfloat16() do); overflow gives inf, NaN stays NaN (quiet); f16 keeps subnormals. Conversions to
// f32 are exact. The f32 -> f16 path is F. Giesen's float_to_half_fast3_rtne (public domain, 2016):
// the exponent is rebiased with integer adds, subnormals are rounded by the FPU in one float add.

SLIDE_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
SLIDE_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

SLIDE_HD uint16_t f32_to_f16(float f) {
  uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7FFFFFFFu;
  uint32_t o;
  if (x >= 0x47800000u) {  // |f| >= 2^16 (beyond f16's range even after rounding), inf or NaN
    o = x > 0x7F800000u ? 0x7E00u : 0x7C00u;
  } else if (x < 0x38800000u) {  // |f| < 2^-14: an f16 subnormal or zero, rounded by one float add
    const float magic = bits_float(126u << 23);  // 0.5: its ulp is f16's subnormal step, 2^-24
    o = float_bits(bits_float(x) + magic) - (126u << 23);
  } else {
    const uint32_t odd = (x >> 13) & 1u;  // ties to even
    x += ((15u - 127u) << 23) + 0xFFFu;   // rebias the exponent (wraps as intended), round half down
    x += odd;
    o = x >> 13;
  }
  return static_cast<uint16_t>(o | sign);
}

SLIDE_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: mant x 2^-24, exact in f32
    return bits_float(float_bits(static_cast<float>(mant) * 5.9604644775390625e-8f) | sign);
  }
  if (exp == 31) return bits_float(sign | 0x7F800000u | (mant << 13));  // inf, NaN (payload kept)
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

SLIDE_HD uint16_t f32_to_bf16(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);  // NaN, quiet
  x += 0x7FFFu + ((x >> 16) & 1u);  // round to nearest, ties to even; a carry may reach inf (overflow)
  return static_cast<uint16_t>(x >> 16);
}

SLIDE_HD float bf16_to_f32(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// --- Reductions (backend.h: sum_of_squares) -------------------------------------------------------
// One element's term of the sum of squares, in double (the accumulator's type).
template <typename T>
SLIDE_HD double squared(T x) {
  return static_cast<double>(x) * static_cast<double>(x);
}

// --- Activations (backend.h: relu_*, tanh_backward, sigmoid_*) -----------------------------------
// y = max(x, 0); NaN propagates as PyTorch's relu does not (x > 0 is false for NaN: y = 0).
template <typename T>
SLIDE_HD T relu(T x) {
  return x > T(0) ? x : T(0);
}
// dx = dy where y > 0, else 0 (y is the forward output).
template <typename T>
SLIDE_HD T relu_grad(T y, T dy) {
  return y > T(0) ? dy : T(0);
}
// d tanh(x) / dx = 1 - tanh(x)^2, from the output y = tanh(x).
template <typename T>
SLIDE_HD T tanh_grad(T y, T dy) {
  return dy * (T(1) - y * y);
}
// sigma(x) = 1 / (1 + exp(-x)).
template <typename T>
SLIDE_HD T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}
// d sigma(x) / dx = sigma(x) (1 - sigma(x)), from the output y = sigma(x).
template <typename T>
SLIDE_HD T sigmoid_grad(T y, T dy) {
  return dy * y * (T(1) - y);
}

// --- GELU (Hendrycks & Gimpel, 2016), exact: torch.nn.GELU(approximate='none') ------------------
// gelu(x) = x Phi(x) = x / 2 (1 + erf(x / sqrt 2)), evaluated in double.
template <typename T>
SLIDE_HD T gelu(T x) {
  const double v = x;
  return static_cast<T>(0.5 * v * (1.0 + std::erf(v * 0.70710678118654752440)));
}
// d gelu / dx = Phi(x) + x phi(x), phi the standard normal density; times dy.
template <typename T>
SLIDE_HD T gelu_grad(T x, T dy) {
  const double v = x;
  const double cdf = 0.5 * (1.0 + std::erf(v * 0.70710678118654752440));
  const double pdf = 0.39894228040143267794 * std::exp(-0.5 * v * v);
  return static_cast<T>(double(dy) * (cdf + v * pdf));
}

// --- Batch normalisation (backend.h: batch_norm_*; Ioffe & Szegedy, 2015) ------------------------
// invstd = 1 / sqrt(var + eps), var the biased batch variance (or the running one at inference).
SLIDE_HD double bn_invstd(double var, double eps) { return 1.0 / std::sqrt(var + eps); }
// y = gamma (x - mean) invstd + beta, evaluated in this order in double (batch norm per channel,
// layer norm per row).
template <typename T>
SLIDE_HD T bn_apply(T x, double gamma, double beta, double mean, double invstd) {
  return static_cast<T>(gamma * (double(x) - mean) * invstd + beta);
}
// running = (1 - momentum) running + momentum batch (PyTorch's update; the variance's batch
// statistic is the unbiased one, sum of squares / (M - 1)).
template <typename T>
SLIDE_HD T bn_running(T running, double momentum, double batch) {
  return static_cast<T>((1 - momentum) * double(running) + momentum * batch);
}
// xhat = (x - mean) invstd.
template <typename T>
SLIDE_HD double bn_xhat(T x, double mean, double invstd) {
  return (double(x) - mean) * invstd;
}
// dx = k (M dy - sum dy - xhat sum(dy xhat)), k = gamma invstd / M: the gradient of batch norm in
// training mode with respect to its input, from the two per-channel sums.
template <typename T>
SLIDE_HD T bn_input_grad(T dy, double xhat, double k, double m, double sum_dy, double sum_dy_xhat) {
  return static_cast<T>(k * (m * double(dy) - sum_dy - xhat * sum_dy_xhat));
}

// --- Max pooling (backend.h: max_pool2d_*) ----------------------------------------------------------
// The flat index into x[N*C, H, W] of the first maximum of output (nc, oh, ow)'s window, scanning
// rows then columns and skipping padded positions (PyTorch's tie rule: the first maximum wins);
// -1 when the window holds no input position.
template <typename T>
SLIDE_HD int64_t max_pool_argmax(const T* x, int64_t nc, int64_t oh, int64_t ow, int64_t H, int64_t W, int kernel,
                                 int stride, int pad) {
  int64_t best = -1;
  for (int64_t r = 0; r < kernel; ++r) {
    const int64_t ih = oh * stride - pad + r;
    if (ih < 0 || ih >= H) continue;
    for (int64_t s = 0; s < kernel; ++s) {
      const int64_t iw = ow * stride - pad + s;
      if (iw < 0 || iw >= W) continue;
      const int64_t j = (nc * H + ih) * W + iw;
      if (best < 0 || x[j] > x[best]) best = j;
    }
  }
  return best;
}

// --- Softmax cross-entropy (backend.h; PyTorch's CrossEntropyLoss, reduction='mean') ---------------
// The smoothed target of class c for a sample labelled `label` among `classes`:
// (1 - s) [c == label] + s / classes (Szegedy et al., 2016; torch.nn.CrossEntropyLoss).
SLIDE_HD double cross_entropy_target(int64_t c, int32_t label, double smoothing, int64_t classes) {
  return (c == label ? 1.0 - smoothing : 0.0) + smoothing / double(classes);
}
// d loss / d logit_c = scale (p_c - target_c), scale = w[label] / sum_n w[label_n].
template <typename T>
SLIDE_HD T cross_entropy_grad(T prob, double target, double scale) {
  return static_cast<T>(scale * (double(prob) - target));
}

// --- Optimizer updates (backend.h: sgd_update, adamw_update; torch.optim semantics) --------------
// SGD with momentum, dampening, weight decay (coupled, added to the gradient) and Nesterov, as
// torch.optim.SGD: d = g + wd p; b = first ? d : momentum b + (1 - dampening) d;
// d = nesterov ? d + momentum b : b; p -= lr d. `buf` is null without momentum.
template <typename T>
SLIDE_HD void sgd_step(T& p, T g, T* buf, double lr, double momentum, double dampening, double weight_decay,
                       bool nesterov, bool first_step) {
  double d = double(g) + weight_decay * double(p);
  if (buf != nullptr) {
    const double b = first_step ? d : momentum * double(*buf) + (1 - dampening) * d;
    *buf = static_cast<T>(b);
    d = nesterov ? d + momentum * b : b;
  }
  p = static_cast<T>(double(p) - lr * d);
}

// The bias corrections of Adam at `step` (>= 1): c1 = 1 - beta1^step, c2 = 1 - beta2^step.
struct AdamCorrections {
  double c1, c2;
};
inline AdamCorrections adam_corrections(double beta1, double beta2, int64_t step) {
  return {1 - std::pow(beta1, double(step)), 1 - std::pow(beta2, double(step))};
}

// AdamW (Loshchilov & Hutter, 2019), as torch.optim.AdamW: m = b1 m + (1 - b1) g;
// v = b2 v + (1 - b2) g^2; p = p (1 - lr wd) - lr (m / c1) / (sqrt(v / c2) + eps).
template <typename T>
SLIDE_HD void adamw_step(T& p, T g, T& m, T& v, double lr, double beta1, double beta2, double eps,
                         double weight_decay, AdamCorrections c) {
  const double gi = g;
  const double mi = beta1 * double(m) + (1 - beta1) * gi;
  const double vi = beta2 * double(v) + (1 - beta2) * gi * gi;
  m = static_cast<T>(mi);
  v = static_cast<T>(vi);
  const double decayed = double(p) * (1 - lr * weight_decay);
  p = static_cast<T>(decayed - lr * (mi / c.c1) / (std::sqrt(vi / c.c2) + eps));
}

}  // namespace slide::train::formulas
