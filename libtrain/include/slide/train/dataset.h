// Labelled tiles from one or more slide-tile stores, decoded into NCHW batches.
//
// Labels come from the stores (patch folders: the class folder names; a manifest's label
// column). Class names are the union of the stores' label names in order of appearance, and each
// store's label indices are mapped onto them by name. Splits are by slide, never by tile, so no
// slide has tiles on both sides.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "slide/core/thread_pool.h"
#include "slide/tile/store.h"
#include "slide/train/augment.h"
#include "slide/train/backend.h"
#include "slide/train/stain.h"
#include "slide/train/tensor.h"

namespace slide::train {

// torchvision's ImageNet normalisation (transforms.Normalize in its model docs), RGB order: a pixel
// value v in 0..255 becomes (v / 255 - mean) / std. Shared by the datasets and slide-embed.
inline constexpr float kImageNetMean[3] = {0.485f, 0.456f, 0.406f};
inline constexpr float kImageNetStd[3] = {0.229f, 0.224f, 0.225f};

// One row of a slide labels CSV: the slide's label ("" in a patients-only CSV) and its patient (""
// without a patient column).
struct SlideLabelRow {
  std::string label, patient;
};
// slide_id -> row, from a CSV whose header names `slide_id` and `label` columns, optionally
// `patient` (or `case_id`, CLAM's name for it; other columns ignored; the manifest dialect,
// slide/core/csv.h). Shared by tile and
// bag (MIL) datasets. With `patients_only_ok`, a CSV of `slide_id` and `patient` (or `case_id`)
// without a `label` column is taken too (every row's label ""): the patients group the slides and
// the labels stay the stores' (TileDataset::open). Errors: kNotFound (no such file),
// kInvalidArgument naming the file and line (no such header, a missing field, a duplicate slide id).
[[nodiscard]] Result<std::map<std::string, SlideLabelRow>> read_slide_labels_csv(const std::string& path,
                                                                                bool patients_only_ok = false);

// The validation split's rule over `groups` groups (slides, or patients): groups shuffled with
// `seed`, round(val_fraction x groups) (at least one when val_fraction > 0 and groups >= 2) are
// validation. Returns is_val per group.
std::vector<bool> split_groups(uint32_t groups, double val_fraction, uint64_t seed);

// The same split stratified by class (--stratify): group g's class is group_class[g] (its tiles'
// or bags' most frequent label, the lowest on a tie: group_classes). Each class's groups, in index
// order, are shuffled (the classes in ascending order, one generator seeded with `seed` for all),
// and round(val_fraction x n_c) of its n_c groups are validation, kept within [1, n_c - 1] when
// val_fraction > 0 and n_c >= 2: every class with two groups or more is on both sides; a class of
// one group trains. The total can differ from split_groups' round(val_fraction x groups) by the
// roundings (scikit-learn's StratifiedShuffleSplit rounds per class likewise). Returns is_val per
// group.
std::vector<bool> split_groups_stratified(const std::vector<int32_t>& group_class, double val_fraction,
                                          uint64_t seed);

// K-fold assignment of `groups` groups (--folds): shuffled with `seed` and dealt round-robin, so
// fold sizes differ by one at most. Returns the fold (0..folds-1) of each group. folds >= 1.
std::vector<int> fold_groups(uint32_t groups, int folds, uint64_t seed);

// The same stratified by class (--folds with --stratify): each class's groups (the classes in
// ascending order, one generator seeded with `seed`) shuffled and dealt round-robin, the dealing
// going on from where the previous class's ended, so that every fold has each class's share (to
// one group) and fold sizes still differ by one at most (scikit-learn's StratifiedKFold's aim).
std::vector<int> fold_groups_stratified(const std::vector<int32_t>& group_class, int folds, uint64_t seed);

// Each group's class for the stratified splits: the most frequent of `labels` over the items
// (tiles, or bags) of that group (item_group[i] < groups), the lowest label on a tie; kNoLabel's
// value (-1) counts like any other. Groups without an item get -1.
std::vector<int32_t> group_classes(const std::vector<uint32_t>& item_group, const std::vector<int32_t>& labels,
                                   uint32_t groups);

// TileRef::label of a tile without one (TileDataset::open with allow_unlabelled).
inline constexpr int32_t kNoLabel = -1;

struct TileRef {
  uint32_t store = 0;
  uint64_t tile = 0;     // index in its store
  int32_t label = 0;     // index into class_names(), or kNoLabel
  uint32_t slide = 0;    // index into slide_ids()
};

class TileDataset {
 public:
  // Opens every store and lists its labelled tiles. Errors: those of StoreReader::open (naming
  // the store), kInvalidArgument when a store holds unlabelled tiles ("... has no labels: tile it
  // from patch folders or a manifest with a label column"), when stores disagree on the tile size,
  // or when there are no tiles.
  //
  // With `labels_csv` (a header naming `slide_id` and `label` columns, optionally `patient`; the
  // manifest's CSV dialect, slide/core/csv.h), each slide's label is its row's instead of the
  // store's; classes are the CSV's distinct labels in sorted order. Errors also: kNotFound (no such file), kInvalidArgument
  // naming the file and line (missing columns, a duplicate slide id) or the first slide with no
  // row.
  //
  // A store tiled with --label-from-annotations (its meta's annotation_options) has a label per
  // tile (TileHeader::label, the class of the slide's GeoJSON covering it): without `labels_csv`
  // those are the labels, the slide's own is not used; tiles with none (-1: no class covered
  // enough of them) are left out and counted in unlabelled_tiles_skipped(), and a slide left with
  // no tile is not listed. Errors also: kDataLoss naming the store and tile for a header whose
  // slide or label index does not fit the store's records.
  //
  // With `allow_unlabelled` (prediction on new slides), a slide without a label (in the store, or
  // without a row in `labels_csv`) is listed with label kNoLabel instead of being an error, and so
  // is a tile without one in a store labelled from annotations; labelled() then tells whether every
  // tile has one. load_batch writes kNoLabel for such tiles: only label-free uses (trainer.h's
  // predict) may take them.
  [[nodiscard]] static Result<std::unique_ptr<TileDataset>> open(const std::vector<std::string>& stores,
                                                                 const std::string& labels_csv = "",
                                                                 bool allow_unlabelled = false);

  // Whether every tile has a label (always true unless opened with allow_unlabelled).
  bool labelled() const;
  // Tiles of stores labelled from annotations that open() left out for having no label.
  uint64_t unlabelled_tiles_skipped() const { return unlabelled_tiles_skipped_; }

  const std::vector<std::string>& class_names() const { return class_names_; }
  // Re-indexes the labels onto `names` (a model's class list, e.g. a checkpoint's), matching by
  // name: afterwards class_names() == names and every tile's label indexes it. Classes of `names`
  // that no tile has are allowed (a store with a subset of the classes). Errors: kInvalidArgument
  // naming the first class of the stores that `names` lacks, or a duplicate in `names`.
  [[nodiscard]] Status remap_classes(const std::vector<std::string>& names);
  const std::vector<std::string>& slide_ids() const { return slide_ids_; }  // "store:slide_id"
  // Slide `slide` (an index into slide_ids()): its store's index in the stores given to open(),
  // and its record in that store (the plain slide id, the source path, resolutions).
  uint32_t slide_store(uint32_t slide) const { return slide_store_.at(slide); }
  const slide::tile::SlideRecord& slide_record(uint32_t slide) const { return slide_records_.at(slide); }
  const std::string& store_dir(uint32_t store) const { return store_dirs_.at(store); }
  const std::vector<TileRef>& tiles() const { return tiles_; }
  int64_t tile_size_px() const { return tile_size_; }

  // Stain normalisation (stain.h) of every tile right after it is decoded, before augmentation,
  // the normalisation to ImageNet's mean/std and the caches (cache_in_ram and cache_on_device then
  // hold normalised tiles): call it before those. Default kNone: tiles as stored. Errors:
  // kInvalidArgument for an invalid target (normalise_stain's checks), or when a cache is made.
  [[nodiscard]] Status set_stain(const StainTarget& target);
  const StainTarget& stain() const { return stain_; }

  // Decodes every tile once into host memory from `alloc` (tiles x S x S x 3 bytes), after which
  // load_batch copies from RAM instead of reading and decoding (the trick of pinning a dataset
  // on the device, on the CPU). Errors: kResourceExhausted when it does not fit the budget (the
  // caller may go on without it), and those of reading or decoding a tile.
  [[nodiscard]] Status cache_in_ram(slide::core::ThreadPool* pool, Allocator& alloc);
  size_t decoded_bytes() const { return tiles_.size() * static_cast<size_t>(3 * tile_size_ * tile_size_); }
  bool cached() const { return cache_.defined(); }

  // --cache device: every tile decoded (on `pool`) and uploaded once to be's device, u8 [N,S,S,3]
  // from be.allocator(). Decoded `chunk_bytes` of tiles at a time (at least one tile) into one
  // host buffer, each chunk uploaded into its rows: host memory holds one chunk, not the dataset;
  // when cache_in_ram made a RAM cache before, that is uploaded as it is.
  // Then load_batch_on_device makes batches there. Errors: kInvalidArgument for a host backend
  // (device cpu: use cache_in_ram), kResourceExhausted when it does not fit the device's budget
  // (the caller may go on without it), and those of decoding and the upload.
  [[nodiscard]] Status cache_on_device(Backend& be, slide::core::ThreadPool* pool, size_t chunk_bytes = 64u << 20);
  bool device_cached() const { return device_cache_.defined(); }
  // load_batch's images on the device of the backend that cache_on_device used: the draws made on
  // the host (draw_augment: the same as load_batch's for the same seed), checked and uploaded as
  // records, then Backend::gather_augment. images [N,3,S,S] f32 from be.allocator();
  // host_labels [N] i32 on the host. Errors: kFailedPrecondition without cache_on_device or with
  // another device, the backend's, the allocators'.
  [[nodiscard]] Status load_batch_on_device(Backend& be, const std::vector<size_t>& positions, const Augmentation& aug,
                                            uint64_t seed, Tensor* images, Tensor* host_labels) const;

  // The record header of tile `position` (level-0 x, y, size, label). Errors: the store's.
  [[nodiscard]] Status tile_header(size_t position, slide::tile::TileHeader* header) const;

  // Tile positions split by slide, or by patient when the labels CSV has a `patient` column (the
  // slides of one patient stay together; a slide id found in two stores, e.g. one slide tiled at
  // two resolutions, is one slide): groups shuffled with `seed`, round(val_fraction x
  // groups) (at least one when val_fraction > 0 and there are two groups or more) go to
  // validation (split_groups). With `stratify`, within each class (split_groups_stratified; a
  // group's class is its tiles' most frequent label).
  void split_by_slide(double val_fraction, uint64_t seed, std::vector<size_t>* train, std::vector<size_t>* val,
                      bool stratify = false) const;

  // K-fold cross-validation over the same groups (patients when the labels CSV names them, else
  // slides): the groups shuffled with `seed` and dealt round-robin into `folds` folds (fold_groups;
  // with `stratify`, each class's in turn: fold_groups_stratified); fold `fold` is validation, the
  // rest training. Over fold = 0..folds-1 every group is validated exactly once. Errors:
  // kInvalidArgument (folds < 2, fold outside [0, folds), fewer groups than folds).
  [[nodiscard]] Status split_fold(int folds, int fold, uint64_t seed, std::vector<size_t>* train,
                                  std::vector<size_t>* val, bool stratify = false) const;
  // The number of split groups (patients, or slides).
  uint32_t groups() const;

  // A held-out test set (--test-fraction): round(test_fraction x groups) groups (at least one when
  // test_fraction > 0 and there are two groups or more; with `stratify`, per class as
  // split_groups_stratified), drawn from `seed` on a stream of their own; their tiles go to *test,
  // and split_by_slide and split_fold leave them out from then on. The same stores, labels,
  // fraction, seed and `stratify` give the same test set (evaluate finds it again).
  void hold_out(double test_fraction, uint64_t seed, std::vector<size_t>* test, bool stratify = false);

  // Decodes tiles `positions` (into tiles()) into images [N, 3, S, S] f32, channels normalised
  // with ImageNet's mean and std (torchvision's), and labels [N] i32, both from `alloc`. Each image
  // gets the augmentation `aug` (augment.h: random resized crop, then flip and rotation, then
  // colour jitter) from a generator seeded by (seed, position): the same batch seed gives the same
  // images. Decoding runs on `pool` when given. Errors: the store's (kDataLoss naming store and
  // tile), JPEG decode errors, kInvalidArgument for a tile of another size, the allocator's.
  [[nodiscard]] Status load_batch(const std::vector<size_t>& positions, const Augmentation& aug, uint64_t seed,
                                  slide::core::ThreadPool* pool, Allocator& alloc, Tensor* images,
                                  Tensor* labels) const;
  // The same with flips and rotations only (augment) or none.
  [[nodiscard]] Status load_batch(const std::vector<size_t>& positions, bool augment, uint64_t seed,
                                  slide::core::ThreadPool* pool, Allocator& alloc, Tensor* images,
                                  Tensor* labels) const {
    Augmentation aug;
    aug.flips_rotations = augment;
    return load_batch(positions, aug, seed, pool, alloc, images, labels);
  }

 private:
  std::vector<std::string> store_dirs_;
  std::vector<std::unique_ptr<slide::tile::StoreReader>> stores_;
  std::vector<std::string> class_names_, slide_ids_;
  std::vector<uint32_t> slide_group_;  // per slide: its patient's index, or its slide id's (across stores)
  std::vector<uint32_t> slide_store_;  // per slide: its store's index
  std::vector<bool> held_out_;         // per group, after hold_out: its tiles are the test set
  std::vector<uint32_t> kept_groups() const;  // the groups not held out, in index order
  std::vector<int32_t> tile_group_classes() const;  // per group: group_classes over the tiles
  std::vector<slide::tile::SlideRecord> slide_records_;  // per slide: its store's record
  // Tiles first .. first + count - 1 decoded (on `pool`) into out, count x S x S x 3 bytes.
  Status decode_range(slide::core::ThreadPool* pool, int64_t first, int64_t count, uint8_t* out) const;
  Tensor cache_;                       // u8 [tiles, S, S, 3] when cached in RAM
  Tensor device_cache_;                // u8 [tiles, S, S, 3] on a device (cache_on_device)

  // Tile `position` as S x S RGB into `rgb` (from the cache, or read and decoded).
  [[nodiscard]] Status decode_tile(size_t position, uint8_t* rgb) const;
  std::vector<TileRef> tiles_;
  uint64_t unlabelled_tiles_skipped_ = 0;
  int64_t tile_size_ = 0;
  StainTarget stain_;  // applied by decode_tile after decoding (method kNone: not)
};

}  // namespace slide::train
