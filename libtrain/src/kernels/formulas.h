// The per-element formulas of the op list, written once for every backend.
//
// Each function here is the arithmetic of one element of an op in backend.h: the reference
// backend's loops call them (and through it the cpu backend, which delegates these ops to
// reference's loops), and the cuda backend's kernels call the very same functions, compiled by
// nvcc as __host__ __device__. So the CPU suite (test_reference_ops, test_optimizer, the golden
// step against PyTorch) exercises the code a GPU runs, as llm.c keeps train_gpt2.c and
// train_gpt2.cu name for name.
//
// Rules for this file: no state, no allocation, no library calls other than <cmath>'s exp, sqrt,
// pow, fmod and floor (which CUDA provides in device code); T is the storage type (float or double), and the
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

// --- Product operands at a math precision (backend.h: MathPrecision) -------------------------------
// f rounded to bfloat16 (7 mantissa bits), IEEE binary16 (10 mantissa bits, 5-bit exponent:
// beyond 65504 it rounds to inf, below 2^-24 to zero, subnormals kept) or TF32 (10 mantissa bits,
// f32's 8-bit exponent), round to nearest, ties to even, returned as the f32 it stands for: what
// the reference backend multiplies under kBf16 / kFp16 / kTf32. Overflow gives inf; NaN stays NaN;
// inf and zero are kept. (NVIDIA's cvt.rna.tf32.f32 rounds ties away from zero; TF32 ties are one
// case in 2^13, inside the tolerance the precision contract allows.)
SLIDE_HD float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
SLIDE_HD float round_to_f16(float f) { return f16_to_f32(f32_to_f16(f)); }
SLIDE_HD float round_to_tf32(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) >= 0x7F800000u) return f;  // inf, NaN
  x += 0xFFFu + ((x >> 13) & 1u);  // to nearest, ties to even; a carry may reach inf (overflow)
  return bits_float(x & ~0x1FFFu);
}

// --- Reductions (backend.h: sum_of_squares) -------------------------------------------------------
// One element's term of the sum of squares, in double (the accumulator's type).
template <typename T>
SLIDE_HD double squared(T x) {
  return static_cast<double>(x) * static_cast<double>(x);
}

// --- Activations (backend.h: relu_*, tanh_*, sigmoid_*) -------------------------------------------
// y = max(x, 0), and 0 for NaN (x > 0 is false): as oneDNN's relu on the cpu backend (its JIT's max)
// and cuDNN's under CUDNN_NOT_PROPAGATE_NAN; PyTorch's relu propagates NaN.
template <typename T>
SLIDE_HD T relu(T x) {
  return x > T(0) ? x : T(0);
}
// dx = dy where y > 0, else 0 (y is the forward output).
template <typename T>
SLIDE_HD T relu_grad(T y, T dy) {
  return y > T(0) ? dy : T(0);
}
// tanh(x), the C library's (CUDA's tanhf on the device: within 2 ulp, as its math library
// documents; the host's libm may round the last bit otherwise).
template <typename T>
SLIDE_HD T tanh_act(T x) {
  return std::tanh(x);
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
// The same in f32 arithmetic, for f16 / bf16 storage (backend.h's half-precision ops: the reference
// and cuda both), as PyTorch evaluates GELU on half tensors (in float); on a GPU the double erf cost
// six times the memory's time (an H200 profile of ViT-L/16 at bf16: 14% of the GPU time). Written
// with erfc, 1 + erf(z) = erfc(-z), which keeps its relative accuracy where 1 + erf(z) cancels
// (x below about -2, where gelu is tiny): a few f32 ulps from gelu's double value everywhere, so
// after rounding to 11 or 8 bits at most one half-type ulp apart, and rarely that.
SLIDE_HD float gelu_f32(float x) { return 0.5f * x * std::erfc(-x * 0.70710678118654752440f); }
// d gelu / dx = Phi(x) + x phi(x), phi the standard normal density; times dy.
template <typename T>
SLIDE_HD T gelu_grad(T x, T dy) {
  const double v = x;
  const double cdf = 0.5 * (1.0 + std::erf(v * 0.70710678118654752440));
  const double pdf = 0.39894228040143267794 * std::exp(-0.5 * v * v);
  return static_cast<T>(double(dy) * (cdf + v * pdf));
}

// --- Row softmax (backend.h: softmax_forward, softmax_backward) ----------------------------------
// y_c = exp(x_c - max) / sum_j exp(x_j - max), in double (the row's maximum subtracted so that exp
// cannot overflow): softmax_term is each exp, the caller divides by their sum. Backward, through the
// Jacobian diag(y) - y y^T: dx_c = y_c (dy_c - sum_j dy_j y_j), `dot` being that sum.
SLIDE_HD double softmax_term(double x, double max) { return std::exp(x - max); }
SLIDE_HD double softmax_grad(double y, double dy, double dot) { return y * (dy - dot); }

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
// The running variance's batch statistic from the sum of squared deviations over m values: the
// unbiased sq / (m - 1), or sq / m for a single value (synchronised batch norm, whose global
// count the backend cannot check before the all-reduce; one rank's batch norm refuses m < 2).
SLIDE_HD double bn_unbiased_var(double sq, double m) { return m > 1 ? sq / (m - 1) : sq / m; }
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
// x: a pointer, or any value with operator[](int64_t) giving comparable values (cuda's view of
// half-precision storage as f32).
template <typename X>
SLIDE_HD int64_t max_pool_argmax(X x, int64_t nc, int64_t oh, int64_t ow, int64_t H, int64_t W, int kernel,
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
// With class weights w and label smoothing s over C classes, PyTorch's loss (aten's
// cross_entropy_loss_label_smoothing, LossNLL.cpp) is
//   loss = (1 / W) sum_n [ (1 - s) w[y_n] (-logp[n, y_n]) + (s / C) sum_c w[c] (-logp[n, c]) ],
// W = sum_n w[y_n]: the smoothing term weighs class c by its own weight, not the sample's. So a
// sample's weighted target is t_c = (1 - s) w[y] [c == y] + (s / C) w[c]; without weights (w = 1)
// the familiar (1 - s) one_hot + s / C (Szegedy et al., 2016) and W = N.
SLIDE_HD double cross_entropy_target(int64_t c, int32_t label, double smoothing, int64_t classes,
                                     double w_label = 1.0, double w_c = 1.0) {
  return (c == label ? (1.0 - smoothing) * w_label : 0.0) + smoothing / double(classes) * w_c;
}
// sum_c t_c = (1 - s) w[y] + s (sum_c w[c]) / C; `w_classes_sum` is sum_c w[c] (C without weights,
// which gives exactly 1: (1 - s) + s rounds to 1 for s in [0, 1]).
SLIDE_HD double cross_entropy_target_sum(double w_label, double smoothing, int64_t classes, double w_classes_sum) {
  return (1.0 - smoothing) * w_label + smoothing * (w_classes_sum / double(classes));
}
// d loss / d logit_c = (target_sum p_c - target_c) / W, from d(-logp_k) / d z_c = p_c - [k == c];
// `inv_weight_sum` is 1 / W (0 when W is 0).
template <typename T>
SLIDE_HD T cross_entropy_grad(T prob, double target, double target_sum, double inv_weight_sum) {
  return static_cast<T>((target_sum * double(prob) - target) * inv_weight_sum);
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

// --- Augmentation and normalisation of uint8 tiles (augment.h; TileDataset::load_batch and
// Backend::gather_augment) ------------------------------------------------------------------------
// An image is S x S interleaved RGB; pixel values are u8 / 255 in [0, 1]. The order per image is
// torchvision's, as augment.h states: crop (resampled bilinearly), then brightness, contrast
// (against the mean grey of the whole image after brightness), saturation and hue, each clamped to
// [0, 1], then the flip and rotation, then ImageNet's normalisation.

SLIDE_HD float clamp01(float v) { return v < 0.0f ? 0.0f : (v > 1.0f ? 1.0f : v); }

// torchvision's rgb_to_grayscale for float images (its coefficients: 0.2989, 0.587, 0.114).
SLIDE_HD float gray(const float* p) { return 0.2989f * p[0] + 0.587f * p[1] + 0.114f * p[2]; }

// torchvision's _rgb2hsv and _hsv2rgb (transforms/_functional_tensor.py), per pixel.
SLIDE_HD void rgb_to_hsv(const float* rgb, float* hsv) {
  const float r = rgb[0], g = rgb[1], b = rgb[2];
  float maxc = r, minc = r;
  if (maxc < g) maxc = g;
  if (maxc < b) maxc = b;
  if (g < minc) minc = g;
  if (b < minc) minc = b;
  const bool eqc = maxc == minc;
  const float cr = maxc - minc;
  const float s = cr / (eqc ? 1.0f : maxc);
  const float div = eqc ? 1.0f : cr;
  const float rc = (maxc - r) / div, gc = (maxc - g) / div, bc = (maxc - b) / div;
  float h;
  if (maxc == r) h = bc - gc;
  else if (maxc == g) h = 2.0f + rc - bc;
  else h = 4.0f + gc - rc;
  hsv[0] = std::fmod(h / 6.0f + 1.0f, 1.0f);
  hsv[1] = s;
  hsv[2] = maxc;
}

SLIDE_HD void hsv_to_rgb(const float* hsv, float* rgb) {
  const float h = hsv[0], s = hsv[1], v = hsv[2];
  const float i_f = std::floor(h * 6.0f);
  const float f = h * 6.0f - i_f;
  const int i = ((static_cast<int>(i_f) % 6) + 6) % 6;
  const float p = clamp01(v * (1.0f - s)), q = clamp01(v * (1.0f - s * f)), t = clamp01(v * (1.0f - s * (1.0f - f)));
  const float r[6] = {v, q, p, p, t, v}, g[6] = {t, v, v, q, p, p}, b[6] = {p, p, t, v, v, q};
  rgb[0] = r[i], rgb[1] = g[i], rgb[2] = b[i];
}

// PyTorch's area_pixel_compute_source_index for linear modes (align_corners=False): output index d
// of `size` samples over `extent` source pixels reads source i0 and i1 with weight frac on i1.
SLIDE_HD void crop_source(int64_t d, int64_t extent, int64_t size, int64_t* i0, int64_t* i1, float* frac) {
  const double s = static_cast<double>(extent) / static_cast<double>(size);
  double v = (static_cast<double>(d) + 0.5) * s - 0.5;
  if (v < 0.0) v = 0.0;
  *i0 = static_cast<int64_t>(v);
  if (*i0 > extent - 1) *i0 = extent - 1;
  *i1 = *i0 + 1 < extent - 1 ? *i0 + 1 : extent - 1;
  *frac = static_cast<float>(v - static_cast<double>(*i0));
}

// The bilinear blend of source rows y0, y1 (weight fy on y1) and columns x0, x1 (fx on x1) of the
// box's origin (bx, by); `pixel(yy, xx, c)` gives the source's channel c in [0, 1].
template <typename Pixel>
SLIDE_HD void resample_at(const Pixel& pixel, int64_t bx, int64_t by, int64_t y0, int64_t y1, float fy, int64_t x0,
                          int64_t x1, float fx, float out[3]) {
  for (int c = 0; c < 3; ++c)
    out[c] = (1 - fy) * ((1 - fx) * pixel(by + y0, bx + x0, c) + fx * pixel(by + y0, bx + x1, c)) +
             fy * ((1 - fx) * pixel(by + y1, bx + x0, c) + fx * pixel(by + y1, bx + x1, c));
}

// Output pixel (y, x) of the box (bx, by, bw, bh) of an S x S image resized to S x S, bilinear
// (crop_source for each axis, then resample_at; host loops hoist the row's crop_source).
template <typename Pixel>
SLIDE_HD void resample_crop(const Pixel& pixel, int64_t size, int64_t bx, int64_t by, int64_t bw, int64_t bh,
                            int64_t y, int64_t x, float out[3]) {
  int64_t y0, y1, x0, x1;
  float fy, fx;
  crop_source(y, bh, size, &y0, &y1, &fy);
  crop_source(x, bw, size, &x0, &x1, &fx);
  resample_at(pixel, bx, by, y0, y1, fy, x0, x1, fx, out);
}

// The source pixels resample_crop reads: an S x S u8 tile (as u8 / 255) or an S x S float image.
struct U8Pixel {
  const uint8_t* tile;
  int64_t size;
  SLIDE_HD float operator()(int64_t y, int64_t x, int c) const { return tile[3 * (y * size + x) + c] / 255.0f; }
};
struct FloatPixel {
  const float* image;
  int64_t size;
  SLIDE_HD float operator()(int64_t y, int64_t x, int c) const { return image[3 * (y * size + x) + c]; }
};

// Brightness: x * f, clamped.
SLIDE_HD void jitter_brightness(float* p, float f) {
  for (int c = 0; c < 3; ++c) p[c] = clamp01(f * p[c]);
}

// Contrast against the image's mean grey `mean` (after brightness), clamped.
SLIDE_HD void jitter_contrast(float* p, float f, float mean) {
  for (int c = 0; c < 3; ++c) p[c] = clamp01(f * p[c] + (1 - f) * mean);
}
// Saturation against the pixel's own grey, clamped.
SLIDE_HD void jitter_saturation(float* p, float f) {
  const float g = gray(p);
  for (int c = 0; c < 3; ++c) p[c] = clamp01(f * p[c] + (1 - f) * g);
}
// Hue: the HSV hue rotated by `shift` turns.
SLIDE_HD void jitter_hue(float* p, float shift) {
  float hsv[3];
  rgb_to_hsv(p, hsv);
  hsv[0] = std::fmod(hsv[0] + shift, 1.0f);
  if (hsv[0] < 0) hsv[0] += 1.0f;  // Python's % is non-negative for a positive divisor
  hsv_to_rgb(hsv, p);
}

// Contrast, then saturation, then hue, each skipped at its identity (1, 1, 0): one pixel's whole
// jitter after brightness (the GPU's order; the host runs each as a pass over the image, which
// gives every pixel the same sequence).
SLIDE_HD void jitter_rest(float* p, float contrast, float mean, float saturation, float hue) {
  if (contrast != 1) jitter_contrast(p, contrast, mean);
  if (saturation != 1) jitter_saturation(p, saturation);
  if (hue != 0) jitter_hue(p, hue);
}

// Stain augmentation in HED space (Tellez et al. 2018, "Whole-slide mitosis detection in H&E
// breast histology using PHH3 as a reference to train distilled stain-invariant convolutional
// networks"; the HEDJitter transform of histology pipelines): the pixel's optical density split
// into haematoxylin, eosin and DAB by colour deconvolution (Ruifrok & Johnston 2001, with
// scikit-image's rgb2hed / hed2rgb conventions: rgb floored at 1e-6, densities log(rgb) /
// log(1e-6) projected with hed_from_rgb = inverse of rgb_from_hed = [[0.65, 0.70, 0.29], [0.07,
// 0.99, 0.11], [0.27, 0.57, 0.78]], negative stains set to 0), each stain s -> s * alpha[c] +
// beta[c], then back to RGB (exp(-(s * -log(1e-6)) @ rgb_from_hed)), clamped to [0, 1].
SLIDE_HD void hed_jitter(float* p, const float* alpha, const float* beta) {
  // hed_from_rgb = inv(rgb_from_hed), row-major (numpy.linalg.inv, 9 significant digits).
  const float from_rgb[9] = {1.877982737f,  -1.007678686f, -0.556115818f, -0.065908062f, 1.134730372f,
                             -0.135521799f, -0.601907363f, -0.480414188f, 1.573588072f};
  const float to_rgb[9] = {0.65f, 0.70f, 0.29f, 0.07f, 0.99f, 0.11f, 0.27f, 0.57f, 0.78f};
  const float log_adjust = -13.815510558f;  // log(1e-6)
  float od[3], hed[3];
  for (int c = 0; c < 3; ++c) od[c] = logf(p[c] > 1e-6f ? p[c] : 1e-6f) / log_adjust;
  for (int k = 0; k < 3; ++k) {
    const float s = od[0] * from_rgb[0 * 3 + k] + od[1] * from_rgb[1 * 3 + k] + od[2] * from_rgb[2 * 3 + k];
    hed[k] = (s > 0 ? s : 0.0f) * alpha[k] + beta[k];
  }
  for (int c = 0; c < 3; ++c) {
    const float log_rgb = (hed[0] * to_rgb[0 * 3 + c] + hed[1] * to_rgb[1 * 3 + c] + hed[2] * to_rgb[2 * 3 + c]) * log_adjust;
    p[c] = clamp01(expf(log_rgb));
  }
}

// Output (y, x) of an S x S image rotated by rot x 90 degrees, then flipped horizontally (flip 1),
// takes source pixel (*sy, *sx).
SLIDE_HD void flip_rotate_source(int64_t y, int64_t x, int64_t size, int flip, int rot, int64_t* sy, int64_t* sx) {
  const int64_t xx = flip ? size - 1 - x : x;
  *sy = y, *sx = xx;
  if (rot == 1) *sy = size - 1 - xx, *sx = y;
  else if (rot == 2) *sy = size - 1 - y, *sx = size - 1 - xx;
  else if (rot == 3) *sy = xx, *sx = size - 1 - y;
}

// torchvision's ImageNet normalisation of channel c (dataset.h: kImageNetMean, kImageNetStd).
SLIDE_HD float imagenet_normalize(float v, int c) {
  // Selects rather than a local array: no array to materialise per pixel in host loops.
  return c == 0 ? (v - 0.485f) / 0.229f : c == 1 ? (v - 0.456f) / 0.224f : (v - 0.406f) / 0.225f;
}

}  // namespace slide::train::formulas
