// Stain normalisation of H&E tiles: fit a target on a reference image, then map every tile's
// colours onto it, so that slides from different scanners and labs look alike. At tiling time
// (slide-tile --stain-normalize: the store's tiles are normalised, and its meta records the target)
// or at load time (slide-embed, slide-train: slide/train/stain.h names these in slide::train).
//
// Three methods:
//
// Reinhard (E. Reinhard, M. Ashikhmin, B. Gooch, P. Shirley, "Color transfer between images",
// IEEE CG&A 21(5), 2001): per-channel mean/std matching. The paper works in Ruderman's l-alpha-beta
// space; like TIAToolbox's ReinhardNormalizer (tiatoolbox.tools.stainnorm, which converts with
// OpenCV's COLOR_RGB2LAB) and staintools we use CIE L*a*b*, here in double precision (no 8-bit
// Lab quantisation), on the WHOLE tile (every pixel, background included, as TIAToolbox does):
//   sRGB (IEC 61966-2-1), 8-bit v -> c = v / 255,
//     linear = c / 12.92 if c <= 0.04045, else ((c + 0.055) / 1.055)^2.4
//   linear RGB -> XYZ (D65) by the sRGB matrix (scikit-image's skimage.color.xyz_from_rgb):
//     X = 0.412453 R + 0.357580 G + 0.180423 B
//     Y = 0.212671 R + 0.715160 G + 0.072169 B
//     Z = 0.019334 R + 0.119193 G + 0.950227 B
//   XYZ -> L*a*b* (CIE 15:2004), white D65 (Xn, Yn, Zn) = (0.95047, 1, 1.08883):
//     f(t) = t^(1/3) if t > (6/29)^3, else t / (3 (6/29)^2) + 4/29
//     L = 116 f(Y/Yn) - 16, a = 500 (f(X/Xn) - f(Y/Yn)), b = 200 (f(Y/Yn) - f(Z/Zn))
//   and back by the exact inverses (f^-1(u) = u^3 if u > 6/29, else 3 (6/29)^2 (u - 4/29); the
//   inverse matrix; linear clipped to [0, 1] before the sRGB encoding
//   c = 12.92 linear if linear <= 0.0031308, else 1.055 linear^(1/2.4) - 0.055).
//   Transform per channel k: out = (x - mean_k) * (ref_std_k / std_k) + ref_mean_k, with the
//   tile's own mean and population std (ddof 0); a channel whose std is below 1e-9 (constant) is
//   shifted only (scale 1). Output rounded to nearest and clipped to 0..255.
//
// Macenko (M. Macenko et al., "A method for normalizing histology slides for quantitative
// analysis", ISBI 2009, pp. 1107-1110), with the conventions of the reference implementations
// (M. Niethammer's and the Warwick stain normalisation toolbox's, as transcribed in
// github.com/schaugf/HEnorm_python; TIAToolbox's MacenkoExtractor and staintools follow the same
// steps):
//   1. optical density per channel OD = -ln((I + 1) / 256) (I = 0..255: OD in [0, ln 256], 0 for
//      white; the "+1" avoids log 0, as HEnorm_python's -log((I + 1) / Io), here with Io = 256 so
//      that I = 255 is exactly transparent);
//   2. tissue pixels: OD >= beta = 0.15 in EVERY channel (pixels with OD < beta in any channel are
//      dropped, as HEnorm_python's ~np.any(OD < beta, axis=1));
//   3. the 3 x 3 covariance of the tissue ODs (sample covariance, np.cov's n - 1; the scale does
//      not change the eigenvectors), its two eigenvectors of largest eigenvalue e1, e2 (Eigen's
//      SelfAdjointEigenSolver), each with its sign flipped so that its first (red) component is
//      >= 0 (TIAToolbox's MacenkoExtractor);
//   4. angle of each tissue OD projected on the plane: phi = atan2(OD . e2, OD . e1); its alpha =
//      1st and (100 - alpha) = 99th percentiles (NumPy's default "linear" percentile: rank
//      p / 100 * (n - 1), interpolated) give v_min = cos(phi_min) e1 + sin(phi_min) e2 and v_max
//      likewise, each normalised to unit length;
//   5. H first: the one with the larger first (red) OD component is haematoxylin (Macenko's
//      heuristic, as in HEnorm_python and TIAToolbox: "if vMin[0] > vMax[0]"), the other eosin:
//      the stain matrix HE, 3 x 2, columns H and E;
//   6. concentrations of EVERY pixel (not just tissue) by least squares, C = argmin |HE c - OD|
//      (the normal equations (HE^T HE)^-1 HE^T OD, 2 x 2, solved exactly), and max_c = the 99th
//      percentile of each stain's concentration over every pixel;
//   7. a tile: C scaled per stain by ref_max_c / max_c, recomposed with the reference's matrix:
//      OD' = HE_ref C', I' = 256 exp(-OD') - 1, rounded to nearest and clipped to 0..255.
//   A tile with fewer tissue pixels than 1% of its pixels (or fewer than 2), or whose 99th
//   percentile concentration is not positive for a stain, is returned UNCHANGED (background, pen,
//   blur: there is no stain to estimate). Fitting a target on such a reference is an error.
//
// Vahadane (A. Vahadane et al., "Structure-preserving color normalization and sparse stain
// separation for histological images", IEEE Trans. Med. Imaging 35(8):1962-1971, 2016): the stains
// by sparse non-negative matrix factorisation of the tissue's optical densities, with the
// conventions of staintools' VahadaneStainExtractor and TIAToolbox's VahadaneExtractor (luminosity
// tissue mask 0.8, dictionary learning with lambda 0.1, H first by its red component, sparse
// concentrations with lambda 0.01, as SPAMS' trainDL / lasso are called there); the solver is ours
// and deterministic:
//   1. optical density as Macenko's step 1;
//   2. tissue pixels: CIE L* < 80 (the L*a*b* above; staintools' L / 255 < 0.8 on OpenCV's 8-bit L);
//   3. dictionary learning: D (3 x 2, D >= 0, columns of norm <= 1) and codes a_i >= 0 minimising
//      sum_i 1/2 |x_i - D a_i|^2 + 0.1 |a_i|_1 over the tissue ODs x_i, by alternating
//      (a) the exact codes of every pixel for the current D (a 2-variable non-negative lasso: the
//          unconstrained minimum G^-1 (D^T x - lambda 1), G = D^T D, when both entries are positive,
//          else the better of the two one-stain minima max(d_j . x - lambda, 0) / |d_j|^2 and zero);
//      (b) one pass of block-coordinate descent over the atoms with A = sum a a^T, B = sum x a^T
//          (J. Mairal, F. Bach, J. Ponce, G. Sapiro, "Online learning for matrix factorization and
//          sparse coding", JMLR 11:19-60, 2010, Algorithm 2, with SPAMS' posD projection):
//          u = max(d_j + (b_j - D a_j) / A_jj, 0), d_j = u / max(|u|, 1) (an atom with A_jj = 0 is
//          kept);
//      from D0 = Ruifrok and Johnston's H and E vectors, normalised (A. C. Ruifrok, D. A. Johnston,
//      "Quantification of histochemical staining by color deconvolution", Anal. Quant. Cytol.
//      Histol. 23(4), 2001: H = (0.650, 0.704, 0.286), E = (0.072, 0.990, 0.105)), until no entry
//      of D moves by 1e-6 or more, at most 100 alternations;
//   4. the atoms normalised to unit length, haematoxylin first (the larger red component, as
//      staintools' "if dictionary[0, 0] < dictionary[1, 0]" swap);
//   5. concentrations of EVERY pixel: the same exact non-negative lasso with lambda 0.01; max_c
//      the 99th percentile per stain;
//   6. the transform of Macenko's step 7.
//   A tile with fewer tissue pixels than 1% (or 2), whose two stains coincide, or whose 99th
//   percentile concentration is not positive for a stain, is returned UNCHANGED.
#pragma once

#include <cstdint>
#include <string>

#include "slide/core/status.h"

namespace slide::tile {

using slide::core::Result;
using slide::core::Status;

enum class StainMethod { kNone, kReinhard, kMacenko, kVahadane };

// "none" | "reinhard" | "macenko" | "vahadane". Never null.
const char* stain_method_name(StainMethod method);
// Parses "none" / "reinhard" / "macenko" / "vahadane". Errors: kInvalidArgument naming the accepted
// values.
[[nodiscard]] Result<StainMethod> parse_stain_method(const std::string& name);

// A fitted target. Only the fields of `method` are meaningful (the others stay 0).
struct StainTarget {
  StainMethod method = StainMethod::kNone;
  // Reinhard: the reference's per-channel L*, a*, b* mean and population std (L in 0..100).
  double reinhard_mean[3] = {0, 0, 0};
  double reinhard_std[3] = {0, 0, 0};
  // Macenko and Vahadane: the reference's stain matrix, OD units (ln), rows R, G, B, columns H, E
  // (unit columns), and its 99th-percentile concentrations of H and E.
  double stain_matrix[3][2] = {{0, 0}, {0, 0}, {0, 0}};
  double max_concentration[2] = {0, 0};
};

// Fits the target of `method` on a reference image: rgb is w x h interleaved 8-bit RGB, row-major
// (3 * w * h bytes). kNone gives an empty target (method kNone). Formulas: the header comment.
// Errors: kInvalidArgument for a null pointer or w, h < 1, and (Macenko) a reference with too few
// tissue pixels (fewer than 1% or 2 pixels with OD >= 0.15 in every channel; Vahadane: with
// L* < 80) or a degenerate stain estimate (a non-positive 99th-percentile concentration, two equal
// stains), saying so. Cost: Macenko one pass over the pixels; Vahadane up to 100 passes over the
// tissue pixels (normalise_stain, fit included, measured on 36 Kather/LC25000 tiles, one thread:
// Vahadane 1.4 s per megapixel, about 70 ms for a 224-px tile; Macenko 0.31 s, Reinhard 0.38 s).
[[nodiscard]] Result<StainTarget> fit_stain_target(StainMethod method, const uint8_t* rgb, int64_t w, int64_t h);

// Normalises a tile in place (w x h interleaved 8-bit RGB, row-major) to `target`: kNone leaves it
// as it is; Reinhard, Macenko and Vahadane as in the header comment (a Macenko or Vahadane tile
// without enough tissue is left unchanged). Pure: thread-safe, any number of threads at once on different tiles (the
// decode threads call it). Errors: kInvalidArgument for a null pointer, w, h < 1, or a target
// whose numbers are not finite (or Reinhard std <= 0, Macenko / Vahadane max_c <= 0).
[[nodiscard]] Status normalise_stain(const StainTarget& target, uint8_t* rgb_inplace, int64_t w, int64_t h);

// The target as one line of JSON, keys sorted (deterministic: the same target gives the same
// string, doubles written with 17 significant digits, so that they read back bit for bit):
// {"method":"none"} | {"method":"reinhard","reinhard_mean":[L,a,b],"reinhard_std":[L,a,b]} |
// {"method":"macenko","macenko_he":[[rH,rE],[gH,gE],[bH,bE]],"macenko_max_c":[H,E]} |
// {"method":"vahadane","vahadane_he":[[rH,rE],[gH,gE],[bH,bE]],"vahadane_max_c":[H,E]}
// (stain_matrix and max_concentration).
std::string stain_target_to_json(const StainTarget& target);
// Parses stain_target_to_json's output. Errors: kInvalidArgument (not JSON, an unknown method, a
// missing or mis-shaped field, a non-finite number), naming what is wrong.
[[nodiscard]] Result<StainTarget> stain_target_from_json(const std::string& json);

// The target of the command-line options `--stain-normalize METHOD --stain-reference FILE`
// (slide-embed, slide-train): kNone without a reference; otherwise fitted on FILE, an image read
// by slide::tile::read_image_file (.jpg/.jpeg, .png, .tif/.tiff: the reference tile), or, when
// FILE ends in ".json", read from it (stain_target_to_json's format: a target recorded before, e.g.
// a bag's stain_normalization attribute), whose method must be METHOD. Errors, all
// kInvalidArgument (usage errors) naming the option and the file: an unknown method, a method
// without a reference or a reference without a method, an unreadable, missing or corrupt file,
// a reference fit_stain_target refuses (too little tissue), a .json of another method.
[[nodiscard]] Result<StainTarget> stain_target_for_options(const std::string& method, const std::string& reference);

// RGB (8-bit) <-> CIE L*a*b* as in the header comment (exposed for the tests): lab = 3 doubles.
void rgb_to_lab(const uint8_t rgb[3], double lab[3]);
// Back to 8-bit sRGB: linear clipped to [0, 1], then rounded to nearest.
void lab_to_rgb(const double lab[3], uint8_t rgb[3]);

}  // namespace slide::tile
