#include "slide/train/dataset.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <numeric>
#include <random>
#include <sstream>

#include "slide/core/csv.h"
#include "slide/core/file.h"
#include "slide/tile/image.h"
#include "op_checks.h"

namespace slide::train {

using CsvRow = SlideLabelRow;

Result<std::map<std::string, SlideLabelRow>> read_slide_labels_csv(const std::string& path, bool patients_only_ok) {
  SLIDE_ASSIGN_OR_RETURN(std::string text, slide::core::read_file(path));
  std::map<std::string, CsvRow> out;
  std::istringstream in(text);
  std::string line;
  int64_t id_col = -1, label_col = -1, patient_col = -1, line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (slide::core::csv_line_is_blank(line)) continue;
    const auto f = slide::core::split_csv_line(line);
    if (id_col < 0) {
      for (size_t i = 0; i < f.size(); ++i) {
        if (f[i] == "slide_id") id_col = static_cast<int64_t>(i);
        if (f[i] == "label") label_col = static_cast<int64_t>(i);
        if (f[i] == "patient" || f[i] == "case_id") patient_col = static_cast<int64_t>(i);  // CLAM's name
      }
      if (id_col < 0 || (label_col < 0 && !(patients_only_ok && patient_col >= 0)))
        return slide::core::invalid_argument(
            path + ":" + std::to_string(line_no) +
            (patients_only_ok ? ": the header must name a slide_id column and a label or patient (case_id) column"
                              : ": the header must name a slide_id and a label column"));
      continue;
    }
    if (static_cast<int64_t>(f.size()) <= std::max(id_col, label_col) ||
        (label_col >= 0 && f[static_cast<size_t>(label_col)].empty()))
      return slide::core::invalid_argument(path + ":" + std::to_string(line_no) +
                                           (label_col >= 0 ? ": missing slide_id or label" : ": missing slide_id"));
    CsvRow row{label_col >= 0 ? f[static_cast<size_t>(label_col)] : std::string(), ""};
    if (patient_col >= 0) {
      if (static_cast<int64_t>(f.size()) <= patient_col || f[static_cast<size_t>(patient_col)].empty())
        return slide::core::invalid_argument(path + ":" + std::to_string(line_no) + ": missing patient");
      row.patient = f[static_cast<size_t>(patient_col)];
    }
    if (!out.emplace(f[static_cast<size_t>(id_col)], row).second)
      return slide::core::invalid_argument(path + ":" + std::to_string(line_no) + ": slide '" +
                                           f[static_cast<size_t>(id_col)] + "' appears twice");
  }
  if (id_col < 0) return slide::core::invalid_argument(path + ": empty");
  return out;
}

namespace {

// 0 .. groups - 1 shuffled by std::shuffle with std::mt19937_64(seed): the plain split's and folds'
// order.
std::vector<uint32_t> shuffled_groups(uint32_t groups, uint64_t seed) {
  std::vector<uint32_t> order(groups);
  std::iota(order.begin(), order.end(), 0u);
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  return order;
}

}  // namespace

std::vector<bool> split_groups(uint32_t groups, double val_fraction, uint64_t seed) {
  const std::vector<uint32_t> order = shuffled_groups(groups, seed);
  size_t n_val = static_cast<size_t>(std::llround(val_fraction * static_cast<double>(order.size())));
  if (val_fraction > 0 && n_val == 0 && order.size() >= 2) n_val = 1;
  n_val = std::min(n_val, order.size());
  std::vector<bool> is_val(order.size(), false);
  for (size_t i = 0; i < n_val; ++i) is_val[order[i]] = true;
  return is_val;
}

namespace {

// The groups of each class of group_class: classes ascending, each class's groups ascending.
std::map<int32_t, std::vector<uint32_t>> groups_by_class(const std::vector<int32_t>& group_class) {
  std::map<int32_t, std::vector<uint32_t>> by_class;
  for (size_t g = 0; g < group_class.size(); ++g) by_class[group_class[g]].push_back(static_cast<uint32_t>(g));
  return by_class;
}

}  // namespace

std::vector<bool> split_groups_stratified(const std::vector<int32_t>& group_class, double val_fraction,
                                          uint64_t seed) {
  std::vector<bool> is_val(group_class.size(), false);
  std::mt19937_64 rng(seed);
  for (auto& [c, members] : groups_by_class(group_class)) {
    std::shuffle(members.begin(), members.end(), rng);
    const size_t n = members.size();
    size_t n_val = 0;
    if (val_fraction > 0 && n >= 2)
      n_val = std::clamp<size_t>(static_cast<size_t>(std::llround(val_fraction * static_cast<double>(n))), 1, n - 1);
    for (size_t i = 0; i < n_val; ++i) is_val[members[i]] = true;
  }
  return is_val;
}

std::vector<int> fold_groups(uint32_t groups, int folds, uint64_t seed) {
  const std::vector<uint32_t> order = shuffled_groups(groups, seed);
  std::vector<int> fold_of(groups, 0);
  for (uint32_t k = 0; k < groups; ++k) fold_of[order[k]] = static_cast<int>(k % static_cast<uint32_t>(folds));
  return fold_of;
}

std::vector<int> fold_groups_stratified(const std::vector<int32_t>& group_class, int folds, uint64_t seed) {
  std::vector<int> fold_of(group_class.size(), 0);
  std::mt19937_64 rng(seed);
  size_t dealt = 0;  // across classes: the next class starts at the fold after the last one dealt
  for (auto& [c, members] : groups_by_class(group_class)) {
    std::shuffle(members.begin(), members.end(), rng);
    for (uint32_t g : members) fold_of[g] = static_cast<int>(dealt++ % static_cast<size_t>(folds));
  }
  return fold_of;
}

std::vector<int32_t> group_classes(const std::vector<uint32_t>& item_group, const std::vector<int32_t>& labels,
                                   uint32_t groups) {
  std::vector<std::map<int32_t, size_t>> counts(groups);
  for (size_t i = 0; i < item_group.size(); ++i) ++counts.at(item_group[i])[labels.at(i)];
  std::vector<int32_t> out(groups, -1);
  for (uint32_t g = 0; g < groups; ++g) {
    size_t best = 0;
    for (const auto& [label, n] : counts[g])  // ascending labels: a tie keeps the lowest
      if (n > best) best = n, out[g] = label;
  }
  return out;
}

Result<std::unique_ptr<TileDataset>> TileDataset::open(const std::vector<std::string>& stores,
                                                       const std::string& labels_csv, bool allow_unlabelled) {
  if (stores.empty()) return slide::core::invalid_argument("no tile stores given");
  auto ds = std::unique_ptr<TileDataset>(new TileDataset());
  std::map<std::string, int32_t> class_index;
  std::map<std::string, CsvRow> csv;
  std::map<std::string, uint32_t> patient_index;
  // A CSV with labels gives the slides' labels; a patients-only one (no label column) only groups
  // the slides, whose labels stay the stores' (the slide records', or the tiles' headers).
  bool csv_labels = false;
  if (!labels_csv.empty()) {
    SLIDE_ASSIGN_OR_RETURN(csv, read_slide_labels_csv(labels_csv, /*patients_only_ok=*/true));
    if (csv.empty()) return slide::core::invalid_argument(labels_csv + ": a header and no rows");
    csv_labels = !csv.begin()->second.label.empty();
  }
  if (csv_labels) {
    std::vector<std::string> names;
    for (const auto& [id, row] : csv) names.push_back(row.label);
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    for (const auto& n : names) {
      class_index.emplace(n, static_cast<int32_t>(ds->class_names_.size()));
      ds->class_names_.push_back(n);
    }
  }
  for (size_t s = 0; s < stores.size(); ++s) {
    SLIDE_ASSIGN_OR_RETURN(auto reader, slide::tile::StoreReader::open(stores[s]));
    const auto& meta = reader->meta();
    if (ds->tile_size_ == 0) ds->tile_size_ = meta.tile_size_px;
    if (meta.tile_size_px != ds->tile_size_)
      return slide::core::invalid_argument("store " + stores[s] + " has " + std::to_string(meta.tile_size_px) +
                                           "-px tiles, " + stores[0] + " has " + std::to_string(ds->tile_size_));
    // A store tiled with --label-from-annotations labels each tile (its header) from the slide's
    // GeoJSON; without a labels CSV, or with a patients-only one, those labels are the ones trained
    // on (the slide's own, from a manifest, is ignored). A tile no class covered enough (-1) is left out, or kept as kNoLabel
    // with allow_unlabelled. Its classes are the label names some tile has: the store's
    // label_names also hold the manifest's slide labels, which are not classes here.
    const bool tile_labels = !csv_labels && meta.annotation_options.find("label_from_annotations=1") != std::string::npos;
    std::vector<std::vector<int32_t>> slide_tile_labels;  // tile-label stores: per slide record, its tiles' labels
    std::vector<bool> used(meta.label_names.size(), !tile_labels);
    if (tile_labels) {
      std::vector<slide::tile::TileHeader> headers;
      for (const auto& rec : reader->slides()) {
        slide_tile_labels.emplace_back();
        if (rec.tile_count == 0) continue;
        SLIDE_RETURN_IF_ERROR(reader->read_tile_headers(rec.first_tile_index, rec.tile_count, &headers));
        for (uint64_t t = 0; t < rec.tile_count; ++t) {
          const slide::tile::TileHeader& h = headers[static_cast<size_t>(t)];
          const std::string where = "store " + stores[s] + ": tile " + std::to_string(rec.first_tile_index + t);
          if (h.slide_index != rec.index)
            return slide::core::data_loss(where + " belongs to slide " + std::to_string(h.slide_index) +
                                          ", its record says slide " + std::to_string(rec.index) + " ('" +
                                          rec.slide_id + "'): data.mdb is damaged");
          if (h.label >= 0 && static_cast<size_t>(h.label) >= used.size())
            return slide::core::data_loss(where + " has label index " + std::to_string(h.label) +
                                          ", the store names " + std::to_string(used.size()) + " labels");
          if (h.label >= 0) used[static_cast<size_t>(h.label)] = true;
          slide_tile_labels.back().push_back(h.label);
        }
      }
    }
    std::vector<int32_t> map_label;
    for (size_t k = 0; k < (csv_labels ? 0 : meta.label_names.size()); ++k) {
      if (!used[k]) {
        map_label.push_back(kNoLabel);
        continue;
      }
      auto [it, inserted] = class_index.emplace(meta.label_names[k], static_cast<int32_t>(ds->class_names_.size()));
      if (inserted) ds->class_names_.push_back(meta.label_names[k]);
      map_label.push_back(it->second);
    }
    for (size_t r = 0; r < reader->slides().size(); ++r) {
      const auto& rec = reader->slides()[r];
      if (rec.tile_count == 0) continue;
      const auto row = csv.find(rec.slide_id);
      if (!csv.empty() && row == csv.end() && !allow_unlabelled)
        return slide::core::invalid_argument(labels_csv + ": no row for slide '" + rec.slide_id + "' of store " +
                                             stores[s]);
      // Group: the patient's (numbered by first appearance) when the CSV names one, else the slide's own.
      const std::string patient = row == csv.end() ? "" : row->second.patient;
      const std::string group_key = patient.empty() ? "\x01slide:" + rec.slide_id : "patient:" + patient;
      if (tile_labels) {
        std::vector<TileRef> kept;
        const auto slide = static_cast<uint32_t>(ds->slide_ids_.size());
        for (uint64_t t = 0; t < rec.tile_count; ++t) {
          const int32_t l = slide_tile_labels[r][static_cast<size_t>(t)];
          if (l < 0 && !allow_unlabelled) {
            ++ds->unlabelled_tiles_skipped_;
            continue;
          }
          kept.push_back(TileRef{static_cast<uint32_t>(s), rec.first_tile_index + t,
                                 l < 0 ? kNoLabel : map_label[static_cast<size_t>(l)], slide});
        }
        if (kept.empty()) continue;
        ds->slide_ids_.push_back(std::to_string(s) + ":" + rec.slide_id);
        ds->slide_store_.push_back(static_cast<uint32_t>(s));
        ds->slide_records_.push_back(rec);
        ds->slide_group_.push_back(
            patient_index.emplace(group_key, static_cast<uint32_t>(patient_index.size())).first->second);
        ds->tiles_.insert(ds->tiles_.end(), kept.begin(), kept.end());
        continue;
      }
      int32_t label = kNoLabel;
      if (csv_labels) {
        if (row != csv.end()) label = class_index.at(row->second.label);
      } else if (rec.label_index >= 0 && static_cast<size_t>(rec.label_index) < map_label.size()) {
        label = map_label[static_cast<size_t>(rec.label_index)];
      } else if (!allow_unlabelled) {
        return slide::core::invalid_argument("store " + stores[s] + ": slide '" + rec.slide_id +
                                             "' has no label: tile it from patch folders or a manifest with a label "
                                             "column, or give --labels CSV");
      }
      const auto slide = static_cast<uint32_t>(ds->slide_ids_.size());
      ds->slide_ids_.push_back(std::to_string(s) + ":" + rec.slide_id);
      ds->slide_store_.push_back(static_cast<uint32_t>(s));
      ds->slide_records_.push_back(rec);
      ds->slide_group_.push_back(
          patient_index.emplace(group_key, static_cast<uint32_t>(patient_index.size())).first->second);
      for (uint64_t t = 0; t < rec.tile_count; ++t)
        ds->tiles_.push_back(TileRef{static_cast<uint32_t>(s), rec.first_tile_index + t, label, slide});
    }
    ds->store_dirs_.push_back(stores[s]);
    ds->stores_.push_back(std::move(reader));
  }
  if (ds->tiles_.empty()) return slide::core::invalid_argument("the tile stores hold no tiles");
  return ds;
}

Status TileDataset::decode_tile(size_t position, uint8_t* rgb) const {
  const int64_t S = tile_size_;
  const size_t bytes = static_cast<size_t>(3 * S * S);
  if (cache_.defined()) {
    std::memcpy(rgb, cache_.data<uint8_t>() + position * bytes, bytes);
    return slide::core::ok_status();
  }
  const TileRef& ref = tiles_.at(position);
  slide::tile::TileHeader h;
  std::vector<uint8_t> payload;
  SLIDE_RETURN_IF_ERROR(stores_[ref.store]->read_tile(ref.tile, &h, &payload));
  const std::string where = "store " + store_dirs_[ref.store] + ": tile " + std::to_string(ref.tile);
  if (h.encoding == slide::tile::TileEncoding::kJpeg) {
    SLIDE_ASSIGN_OR_RETURN(slide::tile::RgbImage img, slide::tile::decode_jpeg(payload));
    if (img.width != S || img.height != S)
      return slide::core::invalid_argument(where + " is " + std::to_string(img.width) + "x" + std::to_string(img.height));
    std::memcpy(rgb, img.pixels.data(), bytes);
  } else {
    if (h.width != S || h.height != S || payload.size() != bytes)
      return slide::core::data_loss(where + ": raw payload size does not match its header");
    std::memcpy(rgb, payload.data(), bytes);
  }
  if (stain_.method != StainMethod::kNone) SLIDE_RETURN_IF_ERROR_CTX(normalise_stain(stain_, rgb, S, S), where);
  return slide::core::ok_status();
}

Status TileDataset::set_stain(const StainTarget& target) {
  if (cache_.defined() || device_cache_.defined())
    return slide::core::invalid_argument("stain normalisation must be set before the dataset is cached");
  uint8_t probe[3] = {128, 128, 128};
  SLIDE_RETURN_IF_ERROR_CTX(normalise_stain(target, probe, 1, 1), "stain normalisation");
  stain_ = target;
  return slide::core::ok_status();
}

Status TileDataset::decode_range(slide::core::ThreadPool* pool, int64_t first, int64_t count, uint8_t* out) const {
  const size_t bytes = static_cast<size_t>(3 * tile_size_ * tile_size_);
  auto range = [&](int64_t a, int64_t b) -> Status {
    for (int64_t i = a; i < b; ++i)
      SLIDE_RETURN_IF_ERROR(decode_tile(static_cast<size_t>(first + i), out + static_cast<size_t>(i) * bytes));
    return slide::core::ok_status();
  };
  const int64_t n = count;
  const int64_t parts = pool != nullptr ? static_cast<int64_t>(pool->size()) : 1;
  std::vector<std::future<Status>> done;
  for (int64_t k = 1; k < parts; ++k) done.push_back(pool->submit([&, k] { return range(n * k / parts, n * (k + 1) / parts); }));
  Status first_error = range(0, n / parts);
  for (auto& f : done) {
    Status s = f.get();
    if (first_error.ok() && !s.ok()) first_error = s;
  }
  return first_error;
}

Status TileDataset::cache_in_ram(slide::core::ThreadPool* pool, Allocator& alloc) {
  const auto n = static_cast<int64_t>(tiles_.size());
  SLIDE_ASSIGN_OR_RETURN(Tensor cache, Tensor::empty({n, tile_size_, tile_size_, 3}, DType::kU8, alloc,
                                                     "decoded dataset (RAM cache)"));
  SLIDE_RETURN_IF_ERROR(decode_range(pool, 0, n, cache.data<uint8_t>()));
  cache_ = std::move(cache);
  return slide::core::ok_status();
}

Status TileDataset::cache_on_device(Backend& be, slide::core::ThreadPool* pool, size_t chunk_bytes) {
  if (be.device() == Device::kCpu)
    return slide::core::invalid_argument("--cache device: the " + be.name() +
                                         " backend computes in host memory; the RAM cache is its device cache");
  if (cached()) {  // the RAM cache is there already: one upload
    SLIDE_ASSIGN_OR_RETURN(device_cache_, to_device(be, cache_, "decoded dataset (device cache)"));
    return slide::core::ok_status();
  }
  // Decoded a chunk at a time into one host buffer and uploaded into its rows of the device
  // cache: host memory stays at one chunk whatever the dataset's size (every rank of a node does
  // this at once, each for its own GPU).
  const auto n = static_cast<int64_t>(tiles_.size());
  const auto row = 3 * tile_size_ * tile_size_;
  const int64_t per_chunk = std::clamp<int64_t>(static_cast<int64_t>(chunk_bytes) / row, 1, std::max<int64_t>(n, 1));
  SLIDE_ASSIGN_OR_RETURN(Tensor dev, Tensor::empty({n, tile_size_, tile_size_, 3}, DType::kU8, be.allocator(),
                                                   "decoded dataset (device cache)"));
  SLIDE_ASSIGN_OR_RETURN(Tensor host, Tensor::empty({per_chunk, tile_size_, tile_size_, 3}, DType::kU8,
                                                    cpu_allocator(), "decoded dataset (upload chunk)"));
  for (int64_t first = 0; first < n; first += per_chunk) {
    const int64_t count = std::min(per_chunk, n - first);
    SLIDE_RETURN_IF_ERROR(decode_range(pool, first, count, host.data<uint8_t>()));
    const Shape rows{count, tile_size_, tile_size_, 3};
    SLIDE_ASSIGN_OR_RETURN(const Tensor src, host.view(0, rows));
    SLIDE_ASSIGN_OR_RETURN(Tensor dst, dev.view(first * row, rows));
    SLIDE_RETURN_IF_ERROR(be.upload(src, dst));  // returns once the copy is done: the chunk is free again
  }
  device_cache_ = std::move(dev);
  return slide::core::ok_status();
}

Status TileDataset::load_batch_on_device(Backend& be, const std::vector<size_t>& positions, const Augmentation& aug,
                                         uint64_t seed, Tensor* images, Tensor* host_labels) const {
  if (!device_cache_.defined() || device_cache_.device() != be.device())
    return slide::core::failed_precondition("load_batch_on_device: the dataset is not cached on " +
                                            std::string(device_name(be.device())));
  const auto n = static_cast<int64_t>(positions.size());
  const int64_t S = tile_size_, N = static_cast<int64_t>(tiles_.size());
  constexpr auto kRecord = static_cast<int64_t>(sizeof(AugmentRecord));
  SLIDE_ASSIGN_OR_RETURN(*host_labels, Tensor::empty({n}, DType::kI32, cpu_allocator(), "label batch"));
  SLIDE_ASSIGN_OR_RETURN(Tensor records, Tensor::empty({n, kRecord}, DType::kU8, cpu_allocator(), "augment records"));
  for (int64_t i = 0; i < n; ++i) {
    const size_t position = positions[static_cast<size_t>(i)];
    host_labels->data<int32_t>()[i] = tiles_.at(position).label;
    AugmentRecord r = draw_augment(aug, seed, position, S);
    r.index = static_cast<int64_t>(position);
    SLIDE_RETURN_IF_ERROR(detail::validate_augment_record(r, N, S));  // before it reaches a kernel
    std::memcpy(records.data<uint8_t>() + i * kRecord, &r, sizeof r);
  }
  SLIDE_ASSIGN_OR_RETURN(Tensor device_records, to_device(be, records, "augment records"));
  SLIDE_ASSIGN_OR_RETURN(*images, Tensor::empty({n, 3, S, S}, DType::kF32, be.allocator(), "image batch"));
  return be.gather_augment(device_cache_, device_records, *images);
}

Status TileDataset::tile_header(size_t position, slide::tile::TileHeader* header) const {
  const TileRef& ref = tiles_.at(position);
  std::vector<uint8_t> payload;
  return stores_[ref.store]->read_tile(ref.tile, header, &payload);
}

bool TileDataset::labelled() const {
  return std::none_of(tiles_.begin(), tiles_.end(), [](const TileRef& t) { return t.label == kNoLabel; });
}

Status TileDataset::remap_classes(const std::vector<std::string>& names) {
  std::map<std::string, int32_t> index;
  for (size_t i = 0; i < names.size(); ++i)
    if (!index.emplace(names[i], static_cast<int32_t>(i)).second)
      return slide::core::invalid_argument("class list has '" + names[i] + "' twice");
  std::vector<int32_t> to(class_names_.size(), -1);
  std::vector<bool> used(class_names_.size(), false);
  for (const TileRef& t : tiles_)
    if (t.label != kNoLabel) used[static_cast<size_t>(t.label)] = true;
  for (size_t c = 0; c < class_names_.size(); ++c) {
    auto it = index.find(class_names_[c]);
    if (it != index.end()) to[c] = it->second;
    else if (used[c])
      return slide::core::invalid_argument("class '" + class_names_[c] + "' of the stores is not one of the model's " +
                                           std::to_string(names.size()) + " classes");
  }
  for (TileRef& t : tiles_)
    if (t.label != kNoLabel) t.label = to[static_cast<size_t>(t.label)];
  class_names_ = names;
  return slide::core::ok_status();
}

std::vector<uint32_t> TileDataset::kept_groups() const {
  std::vector<uint32_t> kept;
  for (uint32_t g = 0; g < groups(); ++g)
    if (held_out_.empty() || !held_out_[g]) kept.push_back(g);
  return kept;
}

std::vector<int32_t> TileDataset::tile_group_classes() const {
  std::vector<uint32_t> item_group(tiles_.size());
  std::vector<int32_t> labels(tiles_.size());
  for (size_t i = 0; i < tiles_.size(); ++i) item_group[i] = slide_group_[tiles_[i].slide], labels[i] = tiles_[i].label;
  return group_classes(item_group, labels, groups());
}

namespace {

// The classes of the groups `kept`, in its order.
std::vector<int32_t> classes_of(const std::vector<int32_t>& group_class, const std::vector<uint32_t>& kept) {
  std::vector<int32_t> out;
  out.reserve(kept.size());
  for (uint32_t g : kept) out.push_back(group_class[g]);
  return out;
}

}  // namespace

void TileDataset::split_by_slide(double val_fraction, uint64_t seed, std::vector<size_t>* train,
                                 std::vector<size_t>* val, bool stratify) const {
  // Over the groups not held out (all of them without hold_out: the split it always was).
  const std::vector<uint32_t> kept = kept_groups();
  const std::vector<bool> kept_is_val =
      stratify ? split_groups_stratified(classes_of(tile_group_classes(), kept), val_fraction, seed)
               : split_groups(static_cast<uint32_t>(kept.size()), val_fraction, seed);
  std::vector<int> role(groups(), -1);  // -1 held out, 0 train, 1 validation
  for (size_t k = 0; k < kept.size(); ++k) role[kept[k]] = kept_is_val[k] ? 1 : 0;
  train->clear();
  val->clear();
  for (size_t i = 0; i < tiles_.size(); ++i) {
    const int r = role[slide_group_[tiles_[i].slide]];
    if (r >= 0) (r == 1 ? val : train)->push_back(i);
  }
}

void TileDataset::hold_out(double test_fraction, uint64_t seed, std::vector<size_t>* test, bool stratify) {
  // A stream of its own (seed salted), so that the held-out groups do not follow the validation
  // split's draw.
  const uint64_t test_seed = seed ^ 0x7E57F00Dull;
  held_out_ = stratify ? split_groups_stratified(tile_group_classes(), test_fraction, test_seed)
                       : split_groups(groups(), test_fraction, test_seed);
  test->clear();
  for (size_t i = 0; i < tiles_.size(); ++i)
    if (held_out_[slide_group_[tiles_[i].slide]]) test->push_back(i);
}

uint32_t TileDataset::groups() const {
  uint32_t groups = 0;
  for (uint32_t g : slide_group_) groups = std::max(groups, g + 1);
  return groups;
}

Status TileDataset::split_fold(int folds, int fold, uint64_t seed, std::vector<size_t>* train,
                               std::vector<size_t>* val, bool stratify) const {
  const std::vector<uint32_t> kept = kept_groups();
  const auto n = static_cast<uint32_t>(kept.size());
  if (folds < 2 || fold < 0 || fold >= folds)
    return slide::core::invalid_argument("fold " + std::to_string(fold) + " of " + std::to_string(folds) +
                                         ": need 2 or more folds and 0 <= fold < folds");
  if (n < static_cast<uint32_t>(folds))
    return slide::core::invalid_argument(std::to_string(folds) + " folds over " + std::to_string(n) +
                                         " groups (patients or slides): at least one group per fold");
  const std::vector<int> kept_fold = stratify ? fold_groups_stratified(classes_of(tile_group_classes(), kept), folds, seed)
                                              : fold_groups(n, folds, seed);
  std::vector<int> fold_of(groups(), -1);  // -1: held out
  for (uint32_t k = 0; k < n; ++k) fold_of[kept[k]] = kept_fold[k];
  train->clear();
  val->clear();
  for (size_t i = 0; i < tiles_.size(); ++i) {
    const int f = fold_of[slide_group_[tiles_[i].slide]];
    if (f >= 0) (f == fold ? val : train)->push_back(i);
  }
  return slide::core::ok_status();
}

Status TileDataset::load_batch(const std::vector<size_t>& positions, const Augmentation& aug, uint64_t seed,
                               slide::core::ThreadPool* pool, Allocator& alloc, Tensor* images,
                               Tensor* labels) const {
  const auto n = static_cast<int64_t>(positions.size());
  const int64_t S = tile_size_;
  SLIDE_ASSIGN_OR_RETURN(*images, Tensor::empty({n, 3, S, S}, DType::kF32, alloc, "image batch"));
  SLIDE_ASSIGN_OR_RETURN(*labels, Tensor::empty({n}, DType::kI32, alloc, "label batch"));
  float* out = images->data<float>();
  auto one = [&](int64_t i) -> Status {
    const TileRef& ref = tiles_.at(positions[static_cast<size_t>(i)]);
    labels->data<int32_t>()[i] = ref.label;
    slide::tile::RgbImage img(S, S);
    SLIDE_RETURN_IF_ERROR(decode_tile(positions[static_cast<size_t>(i)], img.pixels.data()));
    // The draws, then the per-pixel arithmetic shared with Backend::gather_augment (augment.h).
    const AugmentRecord r = draw_augment(aug, seed, positions[static_cast<size_t>(i)], S);
    std::vector<float> scratch(is_identity(r) ? 0 : static_cast<size_t>(3 * S * S));
    augment_image(img.pixels.data(), S, r, out + i * 3 * S * S, scratch.data());
    return slide::core::ok_status();
  };
  if (pool == nullptr || pool->size() < 2) {
    for (int64_t i = 0; i < n; ++i) SLIDE_RETURN_IF_ERROR(one(i));
    return slide::core::ok_status();
  }
  std::vector<std::future<Status>> done;
  for (int64_t i = 0; i < n; ++i) done.push_back(pool->submit([&one, i] { return one(i); }));
  Status first;
  for (auto& f : done) {
    Status s = f.get();
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

}  // namespace slide::train
