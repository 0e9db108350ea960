// Training-time augmentation of RGB tiles, the transforms common in histology: flips and rotations
// by multiples of 90 degrees (a tissue section has no up or left), colour jitter (stain and
// scanner variation) and random resized crops (scale variation).
//
// The colour and crop transforms follow torchvision.transforms (v0.14) so that a recipe written
// for PyTorch means the same here:
// - ColorJitter(brightness b, contrast c, saturation s, hue h): factors drawn uniformly from
//   [max(0, 1 - b), 1 + b], [max(0, 1 - c), 1 + c], [max(0, 1 - s), 1 + s] and a hue shift from
//   [-h, h] (a fraction of the hue circle, h <= 0.5). torchvision applies the four in a random
//   order; here the order is fixed (brightness, contrast, saturation, hue). Each op is
//   torchvision's functional one on float images in [0, 1], clamped to [0, 1] after each.
// - RandomResizedCrop(size = tile size, scale = (min_scale, 1), ratio = (3/4, 4/3)): up to ten
//   draws of an area fraction and a log-uniform aspect ratio, else the whole tile; the crop is
//   resized back to the tile size with bilinear interpolation (half-pixel centres, as
//   torch.nn.functional.interpolate(align_corners=False) without antialiasing).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace slide::train {

struct Augmentation {
  bool flips_rotations = false;  // random horizontal flip and rotation by k x 90 degrees
  float brightness = 0, contrast = 0, saturation = 0, hue = 0;  // ColorJitter's arguments; 0 = off
  float crop_min_scale = 1;  // RandomResizedCrop's smallest area fraction in (0, 1]; 1 = off
  // Stain augmentation (HED jitter, formulas::hed_jitter): each stain s -> s * alpha + beta with
  // alpha ~ U(1 - sigma, 1 + sigma), beta ~ U(-sigma, sigma) per stain and image; 0 = off.
  float stain_sigma = 0;

  bool color_jitter() const { return brightness > 0 || contrast > 0 || saturation > 0 || hue > 0; }
  bool random_crop() const { return crop_min_scale < 1; }
  bool stain_jitter() const { return stain_sigma > 0; }
  bool any() const { return flips_rotations || color_jitter() || random_crop() || stain_jitter(); }
};

// The factors one image gets (identity: 1, 1, 1, 0).
struct JitterFactors {
  float brightness = 1, contrast = 1, saturation = 1, hue = 0;
};
JitterFactors draw_jitter(const Augmentation& aug, std::mt19937_64& rng);

// torchvision's functional ops, in place on `hwc`: n pixels of interleaved RGB floats in [0, 1].
// brightness: x * f. contrast: f x + (1 - f) mean(gray) with gray = 0.299 R + 0.587 G + 0.114 B
// (ITU-R 601-2, torchvision's rgb_to_grayscale), the mean over the whole image. saturation:
// f x + (1 - f) gray per pixel. hue: the HSV hue rotated by `shift` turns (RGB -> HSV -> RGB as
// torchvision's _rgb2hsv / _hsv2rgb). Each result is clamped to [0, 1].
void apply_jitter(const JitterFactors& f, float* hwc, int64_t n);

// A crop box in pixels of an S x S image: top-left (x, y), width w, height h (all > 0, inside).
struct CropBox {
  int64_t x = 0, y = 0, w = 0, h = 0;
};
// RandomResizedCrop.get_params for an S x S image with scale (min_scale, 1), ratio (3/4, 4/3).
CropBox draw_crop(int64_t size, float min_scale, std::mt19937_64& rng);

// The box of `src` (S x S, RGB floats HWC) resized to S x S into `dst` with bilinear
// interpolation, half-pixel centres (align_corners=False), no antialiasing.
void resize_crop(const float* src, int64_t size, const CropBox& box, float* dst);

// One image of a batch as drawn on the host: which tile, and everything random about its
// augmentation. The records of a batch, uploaded as bytes, tell Backend::gather_augment what to do
// on the device, so a batch augmented there has the draws it has on the host. Plain data: the
// layout is shared by the host and the CUDA kernels.
struct AugmentRecord {
  int64_t index = 0;                   // the tile's row in the decoded dataset [N, S, S, 3]
  int32_t flip = 0, rot = 0;           // horizontal flip (0 or 1), then rotation by rot x 90 degrees
  int32_t crop = 0;                    // 1: resample the box below (RandomResizedCrop)
  int32_t crop_x = 0, crop_y = 0, crop_w = 0, crop_h = 0;
  int32_t padding = 0;                 // explicit, so that every byte of a record is defined
  float brightness = 1, contrast = 1, saturation = 1, hue = 0;  // JitterFactors
  int32_t stain = 0;                   // 1: HED jitter with the factors below, after the colour jitter
  int32_t padding2 = 0;
  float stain_alpha[3] = {1, 1, 1}, stain_beta[3] = {0, 0, 0};
};
static_assert(sizeof(AugmentRecord) == 88 && alignof(AugmentRecord) == 8,
              "AugmentRecord is shared with device code: keep its layout");

// The draws of tile `position` (TileDataset positions) for batch seed `seed` and S x S tiles: a
// generator seeded by (seed, position) draws the flip and rotation (when aug.flips_rotations),
// then the crop box (aug.random_crop()), then the jitter factors (aug.color_jitter()), then the
// stain factors (aug.stain_jitter(): alpha then beta for H, E, D in turn). `index` is left 0 for
// the caller.
AugmentRecord draw_augment(const Augmentation& aug, uint64_t seed, uint64_t position, int64_t size);

// Tile `rgb` (S x S x 3 uint8) augmented as `r` says and normalised with ImageNet's mean and std
// into `chw` (3 x S x S floats), the per-pixel arithmetic of kernels/formulas.h (which the CUDA
// kernels share). `scratch`: 3 x S x S floats of working space (unused, and may be null, when
// is_identity(r)).
bool is_identity(const AugmentRecord& r);
void augment_image(const uint8_t* rgb, int64_t size, const AugmentRecord& r, float* chw, float* scratch);

}  // namespace slide::train
