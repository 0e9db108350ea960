// Stain normalisation (Reinhard 2001, Macenko 2009, Vahadane 2016): the formulas and their sources
// are in slide/tile/stain.h. Re-implemented from the papers and the documented steps of TIAToolbox's
// tiatoolbox.tools.stainnorm / stainextract, staintools and HEnorm_python; no code copied.
#include "slide/tile/stain.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <vector>

#include "slide/core/file.h"
#include "slide/tile/image.h"

namespace slide::tile {

namespace {

using slide::core::invalid_argument;
using slide::core::ok_status;

// sRGB -> XYZ (D65), scikit-image's xyz_from_rgb; rows X, Y, Z.
constexpr double kRgbToXyz[3][3] = {{0.412453, 0.357580, 0.180423},
                                    {0.212671, 0.715160, 0.072169},
                                    {0.019334, 0.119193, 0.950227}};
// D65 reference white (scikit-image's "D65", 2-degree observer).
constexpr double kWhite[3] = {0.95047, 1.0, 1.08883};
constexpr double kDelta = 6.0 / 29.0;

// The inverse of kRgbToXyz, computed once (thread-safe function-local static).
const Eigen::Matrix3d& xyz_to_rgb() {
  static const Eigen::Matrix3d inv = [] {
    Eigen::Matrix3d m;
    for (int r = 0; r < 3; ++r)
      for (int c = 0; c < 3; ++c) m(r, c) = kRgbToXyz[r][c];
    return Eigen::Matrix3d(m.inverse());
  }();
  return inv;
}

// sRGB decoding of an 8-bit value (IEC 61966-2-1), tabulated once.
const double* srgb_to_linear_table() {
  static const std::vector<double> t = [] {
    std::vector<double> v(256);
    for (int i = 0; i < 256; ++i) {
      const double c = i / 255.0;
      v[static_cast<size_t>(i)] = c <= 0.04045 ? c / 12.92 : std::pow((c + 0.055) / 1.055, 2.4);
    }
    return v;
  }();
  return t.data();
}

double lab_f(double t) {
  return t > kDelta * kDelta * kDelta ? std::cbrt(t) : t / (3 * kDelta * kDelta) + 4.0 / 29.0;
}
double lab_f_inv(double u) { return u > kDelta ? u * u * u : 3 * kDelta * kDelta * (u - 4.0 / 29.0); }

uint8_t to_u8(double v) {
  const double r = std::floor(v + 0.5);
  return static_cast<uint8_t>(std::clamp(r, 0.0, 255.0));
}

// NumPy's default ("linear") percentile of v (which is reordered): rank p / 100 * (n - 1).
double percentile(std::vector<double>& v, double p) {
  const size_t n = v.size();
  const double rank = p / 100.0 * static_cast<double>(n - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, n - 1);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(lo), v.end());
  const double a = v[lo];
  double b = a;
  if (hi != lo) b = *std::min_element(v.begin() + static_cast<std::ptrdiff_t>(lo) + 1, v.end());
  return a + (b - a) * (rank - static_cast<double>(lo));
}

constexpr double kBeta = 0.15;         // Macenko's OD threshold
constexpr double kAlpha = 1.0;         // Macenko's angle percentile
constexpr double kMinTissue = 0.01;    // fraction of tissue pixels below which a tile is left alone
constexpr double kMaxCPercentile = 99.0;

// Optical density of an 8-bit value, OD = -ln((v + 1) / 256) (the header's step 1), tabulated once.
const double* optical_density_table() {
  static const std::vector<double> t = [] {
    std::vector<double> v(256);
    for (int i = 0; i < 256; ++i) v[static_cast<size_t>(i)] = -std::log((i + 1.0) / 256.0);
    return v;
  }();
  return t.data();
}

// The Gram matrix D^T D of a 3 x 2 stain matrix: g00, g01 (= g10), g11.
struct Gram {
  double g00, g01, g11;
  explicit Gram(const double d[3][2])
      : g00(d[0][0] * d[0][0] + d[1][0] * d[1][0] + d[2][0] * d[2][0]),
        g01(d[0][0] * d[0][1] + d[1][0] * d[1][1] + d[2][0] * d[2][1]),
        g11(d[0][1] * d[0][1] + d[1][1] * d[1][1] + d[2][1] * d[2][1]) {}
};

// Euclidean length of column j of a 3 x 2 stain matrix.
double column_norm(const double d[3][2], int j) {
  return std::sqrt(d[0][j] * d[0][j] + d[1][j] * d[1][j] + d[2][j] * d[2][j]);
}

enum class Estimate { kOk, kTooFewTissue, kDegenerate };

// Macenko steps 1-6 on n pixels: the stain matrix (3 x 2) and the 99th-percentile concentrations;
// `conc` gets every pixel's concentrations (n x 2, H then E) for the transform.
Estimate macenko_estimate(const uint8_t* rgb, int64_t n, double he[3][2], double max_c[2], std::vector<double>* conc) {
  std::vector<double> od(static_cast<size_t>(3 * n));
  const double* table = optical_density_table();
  for (int64_t i = 0; i < 3 * n; ++i) od[static_cast<size_t>(i)] = table[rgb[i]];
  // Step 2: tissue pixels.
  std::vector<int64_t> tissue;
  for (int64_t i = 0; i < n; ++i) {
    const double* p = &od[static_cast<size_t>(3 * i)];
    if (p[0] >= kBeta && p[1] >= kBeta && p[2] >= kBeta) tissue.push_back(i);
  }
  const int64_t nt = static_cast<int64_t>(tissue.size());
  if (nt < 2 || static_cast<double>(nt) < kMinTissue * static_cast<double>(n)) return Estimate::kTooFewTissue;
  // Step 3: covariance and its two leading eigenvectors.
  Eigen::Vector3d mean = Eigen::Vector3d::Zero();
  for (int64_t i : tissue) mean += Eigen::Map<const Eigen::Vector3d>(&od[static_cast<size_t>(3 * i)]);
  mean /= static_cast<double>(nt);
  Eigen::Matrix3d cov = Eigen::Matrix3d::Zero();
  for (int64_t i : tissue) {
    const Eigen::Vector3d d = Eigen::Map<const Eigen::Vector3d>(&od[static_cast<size_t>(3 * i)]) - mean;
    cov += d * d.transpose();
  }
  cov /= static_cast<double>(nt - 1);
  Eigen::SelfAdjointEigenSolver<Eigen::Matrix3d> es(cov);
  if (es.info() != Eigen::Success) return Estimate::kDegenerate;
  Eigen::Vector3d e1 = es.eigenvectors().col(2), e2 = es.eigenvectors().col(1);  // ascending eigenvalues
  if (e1(0) < 0) e1 = -e1;
  if (e2(0) < 0) e2 = -e2;
  // Step 4: angles in the plane, their alpha and 100 - alpha percentiles.
  std::vector<double> phi(static_cast<size_t>(nt));
  for (int64_t k = 0; k < nt; ++k) {
    const Eigen::Map<const Eigen::Vector3d> o(&od[static_cast<size_t>(3 * tissue[static_cast<size_t>(k)])]);
    phi[static_cast<size_t>(k)] = std::atan2(o.dot(e2), o.dot(e1));
  }
  const double phi_min = percentile(phi, kAlpha), phi_max = percentile(phi, 100.0 - kAlpha);
  Eigen::Vector3d v_min = std::cos(phi_min) * e1 + std::sin(phi_min) * e2;
  Eigen::Vector3d v_max = std::cos(phi_max) * e1 + std::sin(phi_max) * e2;
  if (v_min.norm() <= 0 || v_max.norm() <= 0) return Estimate::kDegenerate;
  v_min.normalize();
  v_max.normalize();
  // Step 5: haematoxylin first (the larger red OD component).
  const Eigen::Vector3d h = v_min(0) > v_max(0) ? v_min : v_max;
  const Eigen::Vector3d e = v_min(0) > v_max(0) ? v_max : v_min;
  for (int r = 0; r < 3; ++r) he[r][0] = h(r), he[r][1] = e(r);
  // Step 6: least-squares concentrations of every pixel, their 99th percentiles.
  Eigen::Matrix<double, 3, 2> m;
  m.col(0) = h;
  m.col(1) = e;
  const Eigen::Matrix2d gram = m.transpose() * m;
  if (std::abs(gram.determinant()) < 1e-12) return Estimate::kDegenerate;
  const Eigen::Matrix<double, 2, 3> pinv = gram.inverse() * m.transpose();
  conc->resize(static_cast<size_t>(2 * n));
  std::vector<double> ch(static_cast<size_t>(n)), ce(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const Eigen::Vector2d c = pinv * Eigen::Map<const Eigen::Vector3d>(&od[static_cast<size_t>(3 * i)]);
    (*conc)[static_cast<size_t>(2 * i)] = ch[static_cast<size_t>(i)] = c(0);
    (*conc)[static_cast<size_t>(2 * i + 1)] = ce[static_cast<size_t>(i)] = c(1);
  }
  max_c[0] = percentile(ch, kMaxCPercentile);
  max_c[1] = percentile(ce, kMaxCPercentile);
  if (!(max_c[0] > 0) || !(max_c[1] > 0)) return Estimate::kDegenerate;
  return Estimate::kOk;
}

// ---- Vahadane (sparse non-negative stain separation) ---------------------------------------------

constexpr double kVahadaneLuminosity = 80.0;  // tissue: CIE L* below this (staintools' 0.8 of white)
constexpr double kVahadaneLambda = 0.1;       // the dictionary learning's L1 weight
constexpr double kVahadaneConcLambda = 0.01;  // the concentrations' L1 weight
constexpr int kVahadaneMaxIterations = 100;
constexpr double kVahadaneTolerance = 1e-6;   // stop when no dictionary entry moved by more

// argmin over a >= 0 of 1/2 |x - D a|^2 + lambda (a0 + a1), D = (d0 d1) 3 x 2, given the Gram
// matrix g = D^T D (g01 = g10) and c = D^T x: a convex quadratic on the quadrant, so its minimum is
// the unconstrained one when that lies inside, else the best of the two edges' clipped minima and
// the origin. The edges are compared by their objective (without the constant 1/2 |x|^2); the a0
// edge wins a tie.
inline void nonnegative_lasso2(double g00, double g01, double g11, double c0, double c1, double lambda, double* a0,
                               double* a1) {
  const double q0 = c0 - lambda, q1 = c1 - lambda;
  auto objective = [&](double x0, double x1) {
    return 0.5 * (g00 * x0 * x0 + 2 * g01 * x0 * x1 + g11 * x1 * x1) - q0 * x0 - q1 * x1;
  };
  double best0 = 0, best1 = 0, best = 0;  // the origin
  const double det = g00 * g11 - g01 * g01;
  if (det > 1e-12 * g00 * g11 && det > 0) {
    const double i0 = (g11 * q0 - g01 * q1) / det, i1 = (g00 * q1 - g01 * q0) / det;
    if (i0 > 0 && i1 > 0) {
      *a0 = i0, *a1 = i1;  // the unconstrained minimum is feasible: it is the minimum
      return;
    }
  }
  if (g00 > 0 && q0 > 0) {
    const double x0 = q0 / g00, f = objective(x0, 0);
    if (f < best) best = f, best0 = x0, best1 = 0;
  }
  if (g11 > 0 && q1 > 0) {
    const double x1 = q1 / g11, f = objective(0, x1);
    if (f < best) best = f, best0 = 0, best1 = x1;
  }
  *a0 = best0, *a1 = best1;
}

// Vahadane steps 1-6 on n pixels (the header comment): the stain matrix, the 99th-percentile
// concentrations, and every pixel's concentrations in `conc` (n x 2, H then E).
Estimate vahadane_estimate(const uint8_t* rgb, int64_t n, double he[3][2], double max_c[2], std::vector<double>* conc) {
  const double* table = optical_density_table();
  // Steps 1-2: optical densities of the tissue pixels (L* < 80).
  std::vector<double> x;
  x.reserve(static_cast<size_t>(3 * n));
  for (int64_t i = 0; i < n; ++i) {
    double lab[3];
    rgb_to_lab(rgb + 3 * i, lab);
    if (lab[0] < kVahadaneLuminosity)
      for (int k = 0; k < 3; ++k) x.push_back(table[rgb[3 * i + k]]);
  }
  const int64_t nt = static_cast<int64_t>(x.size() / 3);
  if (nt < 2 || static_cast<double>(nt) < kMinTissue * static_cast<double>(n)) return Estimate::kTooFewTissue;
  // Step 3: dictionary learning from Ruifrok and Johnston's H and E vectors.
  double d[3][2] = {{0.650, 0.072}, {0.704, 0.990}, {0.286, 0.105}};
  for (int j = 0; j < 2; ++j) {
    const double norm = column_norm(d, j);
    for (int k = 0; k < 3; ++k) d[k][j] /= norm;
  }
  for (int iteration = 0; iteration < kVahadaneMaxIterations; ++iteration) {
    // (a) sparse coding of every tissue pixel, accumulating A = sum a a^T and B = sum x a^T.
    const Gram g(d);
    double a_mat[2][2] = {{0, 0}, {0, 0}}, b_mat[3][2] = {{0, 0}, {0, 0}, {0, 0}};
    for (int64_t i = 0; i < nt; ++i) {
      const double* p = &x[static_cast<size_t>(3 * i)];
      const double c0 = d[0][0] * p[0] + d[1][0] * p[1] + d[2][0] * p[2];
      const double c1 = d[0][1] * p[0] + d[1][1] * p[1] + d[2][1] * p[2];
      double a0, a1;
      nonnegative_lasso2(g.g00, g.g01, g.g11, c0, c1, kVahadaneLambda, &a0, &a1);
      a_mat[0][0] += a0 * a0, a_mat[0][1] += a0 * a1, a_mat[1][1] += a1 * a1;
      for (int k = 0; k < 3; ++k) b_mat[k][0] += p[k] * a0, b_mat[k][1] += p[k] * a1;
    }
    a_mat[1][0] = a_mat[0][1];
    // (b) one pass of block-coordinate descent over the atoms, projected on d >= 0, |d| <= 1.
    double moved = 0;
    for (int j = 0; j < 2; ++j) {
      if (!(a_mat[j][j] > 0)) continue;  // an unused atom stays where it is
      double u[3];
      for (int k = 0; k < 3; ++k)
        u[k] = std::max(0.0, d[k][j] + (b_mat[k][j] - (d[k][0] * a_mat[0][j] + d[k][1] * a_mat[1][j])) / a_mat[j][j]);
      const double norm = std::sqrt(u[0] * u[0] + u[1] * u[1] + u[2] * u[2]);
      const double scale = norm > 1 ? 1 / norm : 1;
      for (int k = 0; k < 3; ++k) {
        const double v = u[k] * scale;
        moved = std::max(moved, std::abs(v - d[k][j]));
        d[k][j] = v;
      }
    }
    if (moved < kVahadaneTolerance) break;
  }
  // Step 4: unit atoms, haematoxylin first (the larger red OD component).
  for (int j = 0; j < 2; ++j) {
    const double norm = column_norm(d, j);
    if (!(norm > 0)) return Estimate::kDegenerate;
    for (int k = 0; k < 3; ++k) d[k][j] /= norm;
  }
  const int h_col = d[0][0] >= d[0][1] ? 0 : 1;
  for (int k = 0; k < 3; ++k) he[k][0] = d[k][h_col], he[k][1] = d[k][1 - h_col];
  // Step 5: sparse concentrations of EVERY pixel, their 99th percentiles.
  const Gram g(he);
  if (g.g00 * g.g11 - g.g01 * g.g01 < 1e-12) return Estimate::kDegenerate;  // the two stains coincide
  conc->resize(static_cast<size_t>(2 * n));
  std::vector<double> ch(static_cast<size_t>(n)), ce(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double o0 = table[rgb[3 * i]], o1 = table[rgb[3 * i + 1]], o2 = table[rgb[3 * i + 2]];
    const double c0 = he[0][0] * o0 + he[1][0] * o1 + he[2][0] * o2;
    const double c1 = he[0][1] * o0 + he[1][1] * o1 + he[2][1] * o2;
    double a0, a1;
    nonnegative_lasso2(g.g00, g.g01, g.g11, c0, c1, kVahadaneConcLambda, &a0, &a1);
    (*conc)[static_cast<size_t>(2 * i)] = ch[static_cast<size_t>(i)] = a0;
    (*conc)[static_cast<size_t>(2 * i + 1)] = ce[static_cast<size_t>(i)] = a1;
  }
  max_c[0] = percentile(ch, kMaxCPercentile);
  max_c[1] = percentile(ce, kMaxCPercentile);
  if (!(max_c[0] > 0) || !(max_c[1] > 0)) return Estimate::kDegenerate;
  return Estimate::kOk;
}

// The estimate of a stain-matrix method (Macenko or Vahadane).
Estimate stain_matrix_estimate(StainMethod method, const uint8_t* rgb, int64_t n, double he[3][2], double max_c[2],
                               std::vector<double>* conc) {
  return method == StainMethod::kVahadane ? vahadane_estimate(rgb, n, he, max_c, conc)
                                          : macenko_estimate(rgb, n, he, max_c, conc);
}

Status check_image(const void* rgb, int64_t w, int64_t h) {
  if (rgb == nullptr) return invalid_argument("stain normalisation: null image");
  if (w < 1 || h < 1)
    return invalid_argument("stain normalisation: image size " + std::to_string(w) + "x" + std::to_string(h) +
                            " (width and height must be at least 1)");
  return ok_status();
}

bool finite_all(const double* v, int n) {
  for (int i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) return false;
  return true;
}

Status check_target(const StainTarget& t) {
  switch (t.method) {
    case StainMethod::kNone:
      return ok_status();
    case StainMethod::kReinhard:
      if (!finite_all(t.reinhard_mean, 3) || !finite_all(t.reinhard_std, 3))
        return invalid_argument("Reinhard stain target: a mean or std is not finite");
      for (double s : t.reinhard_std)
        if (!(s > 0)) return invalid_argument("Reinhard stain target: a std is not positive");
      return ok_status();
    case StainMethod::kMacenko:
    case StainMethod::kVahadane: {
      const std::string what = t.method == StainMethod::kMacenko ? "Macenko" : "Vahadane";
      if (!finite_all(&t.stain_matrix[0][0], 6) || !finite_all(t.max_concentration, 2))
        return invalid_argument(what + " stain target: a stain vector or max concentration is not finite");
      if (!(t.max_concentration[0] > 0) || !(t.max_concentration[1] > 0))
        return invalid_argument(what + " stain target: a max concentration is not positive");
      return ok_status();
    }
  }
  return invalid_argument("stain target: unknown method");
}

// Per-channel Lab mean and population std of n pixels; lab (3 n doubles) filled.
void lab_stats(const uint8_t* rgb, int64_t n, std::vector<double>* lab, double mean[3], double sd[3]) {
  lab->resize(static_cast<size_t>(3 * n));
  double sum[3] = {0, 0, 0};
  for (int64_t i = 0; i < n; ++i) {
    double* l = &(*lab)[static_cast<size_t>(3 * i)];
    rgb_to_lab(rgb + 3 * i, l);
    for (int k = 0; k < 3; ++k) sum[k] += l[k];
  }
  for (int k = 0; k < 3; ++k) mean[k] = sum[k] / static_cast<double>(n);
  double ss[3] = {0, 0, 0};
  for (int64_t i = 0; i < n; ++i)
    for (int k = 0; k < 3; ++k) {
      const double d = (*lab)[static_cast<size_t>(3 * i + k)] - mean[k];
      ss[k] += d * d;
    }
  for (int k = 0; k < 3; ++k) sd[k] = std::sqrt(ss[k] / static_cast<double>(n));
}

}  // namespace

const char* stain_method_name(StainMethod method) {
  switch (method) {
    case StainMethod::kNone: return "none";
    case StainMethod::kReinhard: return "reinhard";
    case StainMethod::kMacenko: return "macenko";
    case StainMethod::kVahadane: return "vahadane";
  }
  return "none";
}

Result<StainMethod> parse_stain_method(const std::string& name) {
  if (name == "none") return StainMethod::kNone;
  if (name == "reinhard") return StainMethod::kReinhard;
  if (name == "macenko") return StainMethod::kMacenko;
  if (name == "vahadane") return StainMethod::kVahadane;
  return invalid_argument("unknown stain normalisation method '" + name + "' (none, reinhard, macenko or vahadane)");
}

void rgb_to_lab(const uint8_t rgb[3], double lab[3]) {
  const double* lin = srgb_to_linear_table();
  const double r = lin[rgb[0]], g = lin[rgb[1]], b = lin[rgb[2]];
  double f[3];
  for (int k = 0; k < 3; ++k) f[k] = lab_f((kRgbToXyz[k][0] * r + kRgbToXyz[k][1] * g + kRgbToXyz[k][2] * b) / kWhite[k]);
  lab[0] = 116 * f[1] - 16;
  lab[1] = 500 * (f[0] - f[1]);
  lab[2] = 200 * (f[1] - f[2]);
}

void lab_to_rgb(const double lab[3], uint8_t rgb[3]) {
  const double fy = (lab[0] + 16) / 116, fx = fy + lab[1] / 500, fz = fy - lab[2] / 200;
  const Eigen::Vector3d xyz(kWhite[0] * lab_f_inv(fx), kWhite[1] * lab_f_inv(fy), kWhite[2] * lab_f_inv(fz));
  const Eigen::Vector3d lin = xyz_to_rgb() * xyz;
  for (int k = 0; k < 3; ++k) {
    const double l = std::clamp(lin(k), 0.0, 1.0);
    const double c = l <= 0.0031308 ? 12.92 * l : 1.055 * std::pow(l, 1 / 2.4) - 0.055;
    rgb[k] = to_u8(255 * c);
  }
}

Result<StainTarget> fit_stain_target(StainMethod method, const uint8_t* rgb, int64_t w, int64_t h) {
  SLIDE_RETURN_IF_ERROR(check_image(rgb, w, h));
  StainTarget t;
  t.method = method;
  const int64_t n = w * h;
  if (method == StainMethod::kReinhard) {
    std::vector<double> lab;
    lab_stats(rgb, n, &lab, t.reinhard_mean, t.reinhard_std);
    for (double& s : t.reinhard_std) s = std::max(s, 1e-9);  // a constant reference: a valid target
  } else if (method == StainMethod::kMacenko || method == StainMethod::kVahadane) {
    const bool macenko = method == StainMethod::kMacenko;
    const std::string what = macenko ? "Macenko reference" : "Vahadane reference";
    std::vector<double> conc;
    switch (stain_matrix_estimate(method, rgb, n, t.stain_matrix, t.max_concentration, &conc)) {
      case Estimate::kOk:
        break;
      case Estimate::kTooFewTissue:
        return invalid_argument(what + ": too few tissue pixels (fewer than 1% with " +
                                (macenko ? "optical density >= 0.15 in every channel" : "CIE L* < 80") +
                                "): use an H&E tile full of tissue");
      case Estimate::kDegenerate:
        return invalid_argument(what + ": degenerate stain estimate (a stain with no positive concentration, or "
                                "two equal stains): use an H&E tile with both haematoxylin and eosin");
    }
  }
  return t;
}

Status normalise_stain(const StainTarget& target, uint8_t* rgb, int64_t w, int64_t h) {
  SLIDE_RETURN_IF_ERROR(check_image(rgb, w, h));
  SLIDE_RETURN_IF_ERROR(check_target(target));
  const int64_t n = w * h;
  if (target.method == StainMethod::kReinhard) {
    std::vector<double> lab;
    double mean[3], sd[3];
    lab_stats(rgb, n, &lab, mean, sd);
    double scale[3];
    for (int k = 0; k < 3; ++k) scale[k] = sd[k] < 1e-9 ? 1.0 : target.reinhard_std[k] / sd[k];
    for (int64_t i = 0; i < n; ++i) {
      double* l = &lab[static_cast<size_t>(3 * i)];
      for (int k = 0; k < 3; ++k) l[k] = (l[k] - mean[k]) * scale[k] + target.reinhard_mean[k];
      lab_to_rgb(l, rgb + 3 * i);
    }
  } else if (target.method == StainMethod::kMacenko || target.method == StainMethod::kVahadane) {
    double he[3][2], max_c[2];
    std::vector<double> conc;
    if (stain_matrix_estimate(target.method, rgb, n, he, max_c, &conc) != Estimate::kOk)
      return ok_status();  // left unchanged
    const double s0 = target.max_concentration[0] / max_c[0], s1 = target.max_concentration[1] / max_c[1];
    const auto& r = target.stain_matrix;
    for (int64_t i = 0; i < n; ++i) {
      const double c0 = conc[static_cast<size_t>(2 * i)] * s0, c1 = conc[static_cast<size_t>(2 * i + 1)] * s1;
      for (int k = 0; k < 3; ++k) rgb[3 * i + k] = to_u8(256 * std::exp(-(r[k][0] * c0 + r[k][1] * c1)) - 1);
    }
  }
  return ok_status();
}

Result<StainTarget> stain_target_for_options(const std::string& method_name, const std::string& ref) {
  auto method = parse_stain_method(method_name);
  if (!method.ok()) return method.status().with_context("--stain-normalize");
  if (*method == StainMethod::kNone) {
    if (!ref.empty())
      return slide::core::invalid_argument("--stain-reference " + ref +
                                           " needs --stain-normalize reinhard|macenko|vahadane");
    return StainTarget{};
  }
  if (ref.empty())
    return slide::core::invalid_argument(std::string("--stain-normalize ") + method_name +
                                         " needs --stain-reference IMAGE (a JPEG/PNG/TIFF tile to fit the target on)");
  const std::string where = "--stain-reference " + ref;
  auto as_usage = [&](const slide::core::Status& s) {
    return slide::core::invalid_argument(where + ": " + s.message());
  };
  if (ref.size() > 5 && ref.compare(ref.size() - 5, 5, ".json") == 0) {
    auto text = slide::core::read_file(ref);
    if (!text.ok()) return as_usage(text.status());
    auto t = stain_target_from_json(*text);
    if (!t.ok()) return as_usage(t.status());
    if (t->method != *method)
      return slide::core::invalid_argument(where + " holds a " + stain_method_name(t->method) +
                                           " target, not " + method_name);
    return t;
  }
  auto img = slide::tile::read_image_file(ref);
  if (!img.ok()) return as_usage(img.status());
  auto t = fit_stain_target(*method, img->pixels.data(), img->width, img->height);
  if (!t.ok()) return as_usage(t.status());
  return t;
}

std::string stain_target_to_json(const StainTarget& t) {
  nlohmann::json j;
  j["method"] = stain_method_name(t.method);
  if (t.method == StainMethod::kReinhard) {
    j["reinhard_mean"] = {t.reinhard_mean[0], t.reinhard_mean[1], t.reinhard_mean[2]};
    j["reinhard_std"] = {t.reinhard_std[0], t.reinhard_std[1], t.reinhard_std[2]};
  } else if (t.method == StainMethod::kMacenko || t.method == StainMethod::kVahadane) {
    const std::string prefix = stain_method_name(t.method);
    nlohmann::json he = nlohmann::json::array();
    for (const auto& row : t.stain_matrix) he.push_back({row[0], row[1]});
    j[prefix + "_he"] = he;
    j[prefix + "_max_c"] = {t.max_concentration[0], t.max_concentration[1]};
  }
  return j.dump();
}

Result<StainTarget> stain_target_from_json(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument("stain target: not a JSON object");
  if (!j.contains("method") || !j["method"].is_string()) return invalid_argument("stain target: no \"method\" string");
  SLIDE_ASSIGN_OR_RETURN_CTX(StainMethod m, parse_stain_method(j["method"].get<std::string>()), "stain target");
  StainTarget t;
  t.method = m;
  auto numbers = [&](const nlohmann::json& a, size_t n, double* out, const char* what) -> Status {
    if (!a.is_array() || a.size() != n)
      return invalid_argument(std::string("stain target: \"") + what + "\" must be an array of " + std::to_string(n) +
                              " numbers");
    for (size_t i = 0; i < n; ++i) {
      if (!a[i].is_number()) return invalid_argument(std::string("stain target: \"") + what + "\" has a non-number");
      out[i] = a[i].get<double>();
      if (!std::isfinite(out[i])) return invalid_argument(std::string("stain target: \"") + what + "\" is not finite");
    }
    return ok_status();
  };
  auto field = [&](const std::string& key) -> Result<nlohmann::json> {
    if (!j.contains(key)) return invalid_argument("stain target: no \"" + key + "\"");
    return j[key];
  };
  if (m == StainMethod::kReinhard) {
    SLIDE_ASSIGN_OR_RETURN(auto mean, field("reinhard_mean"));
    SLIDE_ASSIGN_OR_RETURN(auto sd, field("reinhard_std"));
    SLIDE_RETURN_IF_ERROR(numbers(mean, 3, t.reinhard_mean, "reinhard_mean"));
    SLIDE_RETURN_IF_ERROR(numbers(sd, 3, t.reinhard_std, "reinhard_std"));
  } else if (m == StainMethod::kMacenko || m == StainMethod::kVahadane) {
    const std::string he_key = std::string(stain_method_name(m)) + "_he";
    const std::string max_key = std::string(stain_method_name(m)) + "_max_c";
    SLIDE_ASSIGN_OR_RETURN(auto he, field(he_key));
    SLIDE_ASSIGN_OR_RETURN(auto mc, field(max_key));
    if (!he.is_array() || he.size() != 3)
      return invalid_argument("stain target: \"" + he_key + "\" must be 3 rows of 2");
    for (size_t r = 0; r < 3; ++r) SLIDE_RETURN_IF_ERROR(numbers(he[r], 2, t.stain_matrix[r], he_key.c_str()));
    SLIDE_RETURN_IF_ERROR(numbers(mc, 2, t.max_concentration, max_key.c_str()));
  }
  SLIDE_RETURN_IF_ERROR(check_target(t));
  return t;
}

}  // namespace slide::tile
