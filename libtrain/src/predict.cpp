#include "slide/train/predict.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "h5_util.h"
#include "slide/core/file.h"
#include "slide/core/file_name.h"
#include "slide/tile/figure.h"
#include "slide/tile/image.h"

namespace slide::train {

namespace fs = std::filesystem;
using slide::core::invalid_argument;
using slide::core::ok_status;

namespace {

Status check_sizes(const std::string& path, const SlidePredictions& p) {
  const size_t k = p.classes.size();
  if (k == 0 || p.coords.empty() || p.coords.size() % 2 != 0 || p.probs.size() != k * (p.coords.size() / 2))
    return invalid_argument(path + ": " + std::to_string(p.probs.size()) + " probabilities for " +
                            std::to_string(p.coords.size() / 2) + " tiles and " + std::to_string(k) + " classes");
  return ok_status();
}

std::vector<double> mean_probabilities(const SlidePredictions& p) {
  const size_t k = p.classes.size(), n = p.probs.size() / k;
  std::vector<double> mean(k, 0.0);
  for (size_t i = 0; i < n; ++i)
    for (size_t c = 0; c < k; ++c) mean[c] += p.probs[i * k + c];
  for (double& m : mean) m /= static_cast<double>(n);
  return mean;
}

Status write_2d(hid_t file, const char* name, hid_t file_type, hid_t mem_type, hsize_t rows, hsize_t cols,
                const void* data, const std::string& path) {
  const hsize_t dims[2] = {rows, cols};
  h5::Id space(H5Screate_simple(2, dims, nullptr), H5Sclose);
  h5::Id ds(H5Dcreate2(file, name, file_type, space.id, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
  if (!ds.ok() || H5Dwrite(ds.id, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    return h5::error(path, std::string("writing /") + name);
  return ok_status();
}

Status write_int_attr(hid_t loc, const char* name, int32_t value, const std::string& path) {
  h5::Id space(H5Screate(H5S_SCALAR), H5Sclose);
  h5::Id attr(H5Acreate2(loc, name, H5T_STD_I32LE, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.ok() || H5Awrite(attr.id, H5T_NATIVE_INT32, &value) < 0)
    return h5::error(path, std::string("attribute ") + name);
  return ok_status();
}

}  // namespace

Status write_predictions_h5(const std::string& path, const SlidePredictions& p) {
  SLIDE_RETURN_IF_ERROR(check_sizes(path, p));
  const size_t k = p.classes.size(), n = p.coords.size() / 2;
  const std::vector<double> mean = mean_probabilities(p);
  const auto by_mean = static_cast<size_t>(std::max_element(mean.begin(), mean.end()) - mean.begin());
  return h5::write_committed(path, [&](const std::string& partial) -> Status {
    h5::Id file(H5Fcreate(partial.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    if (!file.ok()) return h5::error(partial, "cannot create the file");
    SLIDE_RETURN_IF_ERROR(write_2d(file.id, "probs", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, n, k, p.probs.data(), partial));
    SLIDE_RETURN_IF_ERROR(write_2d(file.id, "coords", H5T_STD_I32LE, H5T_NATIVE_INT32, n, 2, p.coords.data(), partial));
    {
      h5::Id coords(H5Dopen2(file.id, "coords", H5P_DEFAULT), H5Dclose);
      if (!coords.ok()) return h5::error(partial, "opening /coords");
      SLIDE_RETURN_IF_ERROR(write_int_attr(coords.id, "patch_size_level0", p.tile_size_l0_px, partial));
      SLIDE_RETURN_IF_ERROR(write_int_attr(coords.id, "patch_size", p.tile_size_px, partial));
    }
    {
      h5::Id root(H5Gopen2(file.id, "/", H5P_DEFAULT), H5Gclose);
      if (!root.ok()) return h5::error(partial, "opening /");
      SLIDE_RETURN_IF_ERROR(h5::write_string_attr(root.id, "slide_id", p.slide_id, partial));
      SLIDE_RETURN_IF_ERROR(h5::write_string_attr(root.id, "label", p.label, partial));
      SLIDE_RETURN_IF_ERROR(h5::write_string_attr(root.id, "checkpoint", p.checkpoint, partial));
      SLIDE_RETURN_IF_ERROR(h5::write_string_attr(root.id, "classes", nlohmann::json(p.classes).dump(), partial));
      SLIDE_RETURN_IF_ERROR(h5::write_string_attr(root.id, "predicted_by_mean", p.classes[by_mean], partial));
      const auto kk = static_cast<hsize_t>(k);
      h5::Id space(H5Screate_simple(1, &kk, nullptr), H5Sclose);
      h5::Id attr(H5Acreate2(root.id, "mean_probabilities", H5T_IEEE_F64LE, space.id, H5P_DEFAULT, H5P_DEFAULT),
                  H5Aclose);
      if (!attr.ok() || H5Awrite(attr.id, H5T_NATIVE_DOUBLE, mean.data()) < 0)
        return h5::error(partial, "attribute mean_probabilities");
    }
    if (H5Fflush(file.id, H5F_SCOPE_GLOBAL) < 0) return h5::error(partial, "flush");
    return h5::close_file(file, partial);
  });
}

Result<std::vector<std::string>> write_class_heatmaps(const std::string& path_prefix, const SlidePredictions& p,
                                                      const HeatmapCanvas* canvas) {
  SLIDE_RETURN_IF_ERROR(check_sizes(path_prefix, p));
  const size_t k = p.classes.size(), n = p.coords.size() / 2;
  std::vector<std::string> written;
  for (size_t c = 0; c < k; ++c) {
    const std::string path = path_prefix + "." + slide::core::slide_file_stem(p.classes[c]) + ".png";
    std::vector<double> values(n);
    for (size_t i = 0; i < n; ++i) values[i] = p.probs[i * k + c];
    auto drawn = canvas != nullptr ? draw_tile_overlay(values, p.coords, p.tile_size_l0_px, *canvas, path)
                                   : draw_tile_grid(values, p.coords, p.tile_size_l0_px, path);
    if (!drawn.ok()) return drawn.status();
    slide::tile::ColourBar bar;
    bar.title = "p(" + p.classes[c] + "): " + p.slide_id;
    bar.scale = "probability, absolute scale (not rescaled per slide)";
    auto figure = slide::tile::add_colour_bar(*drawn, bar);
    if (!figure.ok()) return figure.status().with_context(path);
    SLIDE_ASSIGN_OR_RETURN(std::vector<uint8_t> png, slide::tile::encode_png(*figure));
    SLIDE_RETURN_IF_ERROR(slide::core::write_file_atomic(path, png));
    written.push_back(fs::path(path).filename().string());
  }
  return written;
}

}  // namespace slide::train
