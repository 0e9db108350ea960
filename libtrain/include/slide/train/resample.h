// Resampling on the host, as the encoders' own preprocessing does it:
//
// - Tiles (8-bit RGB) resized to an encoder's input size the way PIL's Image.resize(size,
//   Image.BICUBIC) does (the resize in torchvision's / timm's transforms of PIL images):
//   Pillow's src/libImaging/Resample.c (precompute_coeffs, normalize_coeffs_8bpc,
//   ImagingResampleHorizontal_8bpc / Vertical_8bpc, ImagingResampleInner).
// - Float planes (a ViT's positional-embedding grid) resized as PyTorch's
//   F.interpolate(mode='bicubic', antialias=True, align_corners=False) does, which is what timm's
//   resample_abs_pos_embed calls (timm/layers/pos_embed.py).
//
// Both are the same separable, antialiased convolution per axis (Pillow's precompute_coeffs; in
// PyTorch aten/src/ATen/native/cpu/UpSampleKernel.cpp, _compute_indices_weights_aa, written to
// match PIL). For an axis of `in` samples resized to `out`:
//   scale   = in / out                                 (input px per output px)
//   fscale  = max(scale, 1)                             (the kernel is widened when downsampling:
//                                                        the antialiasing)
//   support = 2 * fscale                                (the cubic kernel's support is 2)
//   centre  = (i + 0.5) * scale                         (pixel centres at i + 0.5)
//   first   = max(int(centre - support + 0.5), 0),  last = min(int(centre + support + 0.5), in)
//   w_j     = K((j + first - centre + 0.5) / fscale),   j = 0 .. last - first - 1
//   weights normalised to sum 1 per output sample.
// K is Keys' cubic convolution kernel (Keys, 1981) with a = -0.5 (Pillow's bicubic_filter; PyTorch's
// antialiased bicubic uses a = -0.5 too, "to match PIL"; its non-antialiased bicubic uses -0.75):
//   K(x) = (a+2)|x|^3 - (a+3)|x|^2 + 1   for |x| < 1
//        = a|x|^3 - 5a|x|^2 + 8a|x| - 4a  for 1 <= |x| < 2,   0 beyond.
// The 2-D resize is the horizontal pass, then the vertical pass; an axis whose size does not
// change is not resampled (Pillow's need_horizontal / need_vertical).
#pragma once

#include <cstdint>
#include <vector>

#include "slide/core/status.h"

namespace slide::train {

using slide::core::Result;
using slide::core::Status;

// Keys' cubic convolution kernel K(x) with parameter a (see above). Pure function.
double cubic_kernel(double x, double a);

// The per-output-sample weights of one axis (formula above), computed once per (in, out) pair.
struct ResampleAxis {
  int64_t in = 0, out = 0;
  int64_t taps = 0;              // weights per output sample (Pillow's ksize = 2 ceil(support) + 1)
  std::vector<int32_t> first;    // [out]: the first input sample of output i
  std::vector<int32_t> count;    // [out]: how many input samples it reads (<= taps)
  std::vector<double> weights;   // [out x taps]: normalised, zero past count
  // Pillow's fixed-point weights for 8-bit images (normalize_coeffs_8bpc): w * 2^22 rounded half
  // away from zero; PRECISION_BITS = 32 - 8 - 2 = 22.
  std::vector<int32_t> fixed;    // [out x taps]
};

// Errors: kInvalidArgument when in or out is < 1 or > 65536 (naming both).
[[nodiscard]] Result<ResampleAxis> antialiased_cubic_axis(int64_t in, int64_t out, double a = -0.5);

// Resizes 8-bit interleaved RGB images of in_w x in_h to out_w x out_h exactly as PIL's
// Image.resize((out_w, out_h), Image.BICUBIC) (Pillow 9/10: the default reducing_gap=None).
// Each pass accumulates in Pillow's integer arithmetic: acc = 2^21 + sum(pixel * fixed weight),
// then the 8-bit result is clamp(acc >> 22, 0, 255) (Pillow's clip8), so each pass rounds and
// clips to 8 bits as Pillow does. The weights are precomputed by create(); resize() is const and
// thread-safe (each call takes its own scratch), so one resizer serves every decode thread.
class BicubicResizer {
 public:
  // Errors: kInvalidArgument for a size < 1 or > 65536.
  [[nodiscard]] static Result<BicubicResizer> create(int64_t in_w, int64_t in_h, int64_t out_w, int64_t out_h);

  // in: in_h x in_w x 3 bytes (row-major, RGB interleaved); out: out_h x out_w x 3 bytes,
  // overwritten. `scratch` is resized as needed (in_h' x out_w x 3 bytes for the horizontal pass'
  // output, in_h' the rows the vertical pass reads); pass a per-thread buffer to avoid reallocating.
  void resize(const uint8_t* in, uint8_t* out, std::vector<uint8_t>& scratch) const;

  int64_t in_w() const { return h_.in; }
  int64_t in_h() const { return v_.in; }
  int64_t out_w() const { return h_.out; }
  int64_t out_h() const { return v_.out; }

 private:
  ResampleAxis h_, v_;
};

// Resizes `channels` float planes [channels, in_h, in_w] (row-major) to [channels, out_h, out_w]
// as torch.nn.functional.interpolate(x, size=(out_h, out_w), mode='bicubic', antialias=True,
// align_corners=False) does (the weights above, a = -0.5, for upsampling and downsampling alike;
// horizontal pass, then vertical), accumulating in double. Equal to PyTorch's float32 result up
// to float rounding (PyTorch accumulates in float). An axis whose size does not change is copied.
// Errors: kInvalidArgument for a size < 1 or > 65536, or channels < 1.
[[nodiscard]] Status resize_planes_bicubic_aa(const float* in, int64_t channels, int64_t in_h, int64_t in_w,
                                              int64_t out_h, int64_t out_w, float* out);

}  // namespace slide::train
