#include "slide/train/embed.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <set>

#include "slide/core/file.h"
#include "slide/core/log.h"
#include "slide/core/progress.h"
#include "slide/core/thread_pool.h"
#include "slide/tile/image.h"
#include "slide/tile/store.h"
#include "slide/core/csv.h"
#include "slide/core/hash.h"
#include "slide/train/dataset.h"
#include "slide/train/resample.h"

namespace slide::train {

using slide::core::invalid_argument;
using slide::core::ok_status;

// ------------------------------------------------------------------------------------------------
// The CNN encoder: the inference graph on a backend

Result<std::unique_ptr<FeatureExtractor>> FeatureExtractor::create(Sequential& model, const std::string& layer,
                                                                   std::unique_ptr<Backend> be) {
  SLIDE_ASSIGN_OR_RETURN(size_t cut, find_cut(model, layer));
  if (be == nullptr) {
    SLIDE_ASSIGN_OR_RETURN(be, make_backend("cpu"));
  }
  SLIDE_ASSIGN_OR_RETURN(InferenceGraph graph, InferenceGraph::build(model, cut));
  SLIDE_RETURN_IF_ERROR_CTX(graph.prepare(*be), "--backend " + be->name());
  return std::unique_ptr<FeatureExtractor>(new FeatureExtractor(std::move(graph), std::move(be), layer));
}

FeatureExtractor::FeatureExtractor(InferenceGraph graph, std::unique_ptr<Backend> be, std::string layer)
    : graph_(std::move(graph)), be_(std::move(be)), layer_(std::move(layer)) {}
FeatureExtractor::~FeatureExtractor() = default;

Status FeatureExtractor::extract(const float* images, int64_t n, int64_t h, int64_t w, float* features) {
  if (n < 1 || h < 1 || w < 1)
    return invalid_argument("extract: " + std::to_string(n) + " images of " + std::to_string(h) + "x" +
                            std::to_string(w) + " px");
  SLIDE_ASSIGN_OR_RETURN(Tensor host, Tensor::empty({n, 3, h, w}, DType::kF32, cpu_allocator(), "images (host)"));
  std::memcpy(host.raw(), images, host.bytes());
  SLIDE_ASSIGN_OR_RETURN(Tensor x, to_device(*be_, host, "images"));
  host = Tensor();  // on a host backend x is host itself; on a device the host copy can go
  Result<Tensor> f = graph_.run(*be_, x);
  if (!f.ok()) return f.status().with_context("layer " + layer_ + ", " + std::to_string(n) + " tiles");
  SLIDE_ASSIGN_OR_RETURN(Tensor out, to_host(*be_, *f, layer_ == "fc" ? "logits (host)" : "features (host)"));
  if (out.rank() != 2 || out.dim(0) != n || out.dim(1) != graph_.feature_dim())
    return slide::core::internal_error("extract: the graph gave " + shape_string(out.shape()) + " for " +
                                       std::to_string(n) + " images");
  std::memcpy(features, out.raw(), out.bytes());
  return ok_status();
}

void FeatureExtractor::release_cached_memory() { be_->allocator().trim_cache(); }

Status extract_in_micro_batches(TileEncoder& encoder, const float* images, int64_t n, int64_t h, int64_t w,
                                float* features, int64_t* micro_batch, int64_t* reruns) {
  if (n < 1 || h < 1 || w < 1)
    return invalid_argument("extract: " + std::to_string(n) + " images of " + std::to_string(h) + "x" +
                            std::to_string(w) + " px");
  int64_t m = micro_batch == nullptr || *micro_batch <= 0 || *micro_batch > n ? n : *micro_batch;
  const int64_t image = 3 * h * w, D = encoder.feature_dim();
  for (int64_t i = 0; i < n;) {
    const int64_t k = std::min(m, n - i);
    Status st = encoder.extract(images + i * image, k, h, w, features + i * D);
    if (st.ok()) {
      i += k;
      continue;
    }
    if (st.code() != slide::core::StatusCode::kResourceExhausted) return st;
    if (k == 1)
      return st.with_context("out of memory with one image per forward pass: no smaller micro-batch is left");
    // Halve what failed (not the remainder: the rows before i are done) and keep the new size.
    const int64_t half = (k + 1) / 2;
    slide::core::log_warn("out of memory in a forward pass: it runs again in smaller micro-batches (same features); "
                          "later batches keep them",
                          {{"error", st.to_string()}, {"micro_batch_before", k}, {"micro_batch_now", half}});
    encoder.release_cached_memory();
    m = half;
    if (micro_batch != nullptr) *micro_batch = m;
    if (reruns != nullptr) ++*reruns;
  }
  return ok_status();
}

// ------------------------------------------------------------------------------------------------
// Stores -> bags

int EmbedSummary::failed() const {
  int n = 0;
  for (const auto& s : slides) n += s.status.ok() || s.status.code() == slide::core::StatusCode::kCancelled ? 0 : 1;
  return n;
}

EmbedSummary::Counts EmbedSummary::counts() const {
  Counts c;
  for (const auto& s : slides) {
    if (!s.status.ok()) continue;
    if (s.skipped) ++c.skipped;
    else if (s.tiles == 0) ++c.empty;
    else ++c.written;
  }
  return c;
}

namespace {

struct SlideJob {
  size_t store = 0;
  slide::tile::SlideRecord record;
};

// Decodes tile `index` of `store` (S x S px) into `dst` (3 x E x E, normalised) and its
// coordinates. With a stain target (method not kNone) the decoded 8-bit tile is first
// stain-normalised in place (stain.h). With a resizer (S != E: the encoder's input size) the
// 8-bit tile is then resized to E x E as PIL's Image.resize(BICUBIC) (resample.h), on the calling
// decode thread.
// The tile's header must name `slide_index` (the slide record it was listed under): a store whose
// records and tiles disagree is kDataLoss, as in TileDataset::open.
Status decode_into(const slide::tile::StoreReader& store, const std::string& store_dir, uint32_t slide_index,
                   uint64_t index, int64_t S, const StainTarget& stain, const BicubicResizer* resizer,
                   const float (*lut)[256], float* dst, int64_t* xy) {
  slide::tile::TileHeader hdr;
  std::vector<uint8_t> payload;
  const std::string where = "store " + store_dir + ": tile " + std::to_string(index);
  SLIDE_RETURN_IF_ERROR(store.read_tile(index, &hdr, &payload));  // names the store and the tile
  if (hdr.slide_index != slide_index)
    return slide::core::data_loss(where + " belongs to slide " + std::to_string(hdr.slide_index) +
                                  ", but slide " + std::to_string(slide_index) + "'s record lists it");
  slide::tile::RgbImage img;
  if (hdr.encoding == slide::tile::TileEncoding::kJpeg) {
    SLIDE_ASSIGN_OR_RETURN_CTX(img, slide::tile::decode_jpeg(payload), where);
  } else {
    img.width = hdr.width, img.height = hdr.height, img.pixels = std::move(payload);
    if (img.pixels.size() != static_cast<size_t>(3 * img.width * img.height))
      return slide::core::data_loss(where + ": raw payload size does not match its width and height");
  }
  if (img.width != S || img.height != S)
    return slide::core::data_loss(where + " is " + std::to_string(img.width) + "x" + std::to_string(img.height) +
                                  ", not " + std::to_string(S) + "x" + std::to_string(S));
  if (stain.method != StainMethod::kNone)
    SLIDE_RETURN_IF_ERROR_CTX(normalise_stain(stain, img.pixels.data(), img.width, img.height), where);
  const uint8_t* px = img.pixels.data();
  int64_t E = S;
  if (resizer != nullptr) {
    thread_local std::vector<uint8_t> resized, scratch;  // per decode thread, reused across tiles
    E = resizer->out_w();
    resized.resize(static_cast<size_t>(3 * E * E));
    resizer->resize(px, resized.data(), scratch);
    px = resized.data();
  }
  const int64_t plane = E * E;
  for (int64_t i = 0; i < plane; ++i) {
    dst[i] = lut[0][px[3 * i]];
    dst[plane + i] = lut[1][px[3 * i + 1]];
    dst[2 * plane + i] = lut[2][px[3 * i + 2]];
  }
  xy[0] = hdr.x_l0;
  xy[1] = hdr.y_l0;
  return ok_status();
}

}  // namespace

const float* TileEncoder::mean() const { return kImageNetMean; }
const float* TileEncoder::std() const { return kImageNetStd; }

std::string bag_directory(const EmbedOptions& options) {
  return options.layout == "clam" ? options.out_dir + "/h5_files" : options.out_dir;
}

Result<EmbedSummary> embed_stores(TileEncoder& extractor, const EmbedModel& model, const EmbedOptions& opt) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  if (opt.stores.empty()) return invalid_argument("no tile stores given");
  if (opt.batch < 1) return invalid_argument("--batch-size must be at least 1");
  {
    // An invalid target fails the run here, not every tile.
    uint8_t probe[3] = {128, 128, 128};
    SLIDE_RETURN_IF_ERROR_CTX(normalise_stain(opt.stain, probe, 1, 1), "stain normalisation");
  }
  const std::string stain_json =
      opt.stain.method != StainMethod::kNone ? stain_target_to_json(opt.stain) : std::string();
  const std::string precision_attr =
      model.precision != MathPrecision::kFp32 ? math_precision_name(model.precision) : std::string();
  std::vector<std::unique_ptr<slide::tile::StoreReader>> stores;
  // Tiles of another size than the encoder's input are resized to it on the decode threads, as
  // the encoders' own transforms do (PIL's bicubic, antialiased: resample.h); one resizer (its
  // weights precomputed) per tile size, shared by the threads.
  const int64_t need = extractor.input_size();
  std::map<int64_t, std::unique_ptr<const BicubicResizer>> resizers;
  for (const auto& dir : opt.stores) {
    SLIDE_ASSIGN_OR_RETURN(auto r, slide::tile::StoreReader::open(dir));  // its errors name the store
    const int64_t have = r->meta().tile_size_px;
    if (need > 0 && have != need) {
      if (resizers.count(have) == 0) {
        SLIDE_ASSIGN_OR_RETURN_CTX(BicubicResizer rs, BicubicResizer::create(have, have, need, need), "store " + dir);
        resizers.emplace(have, std::make_unique<const BicubicResizer>(std::move(rs)));
      }
      slide::core::log_info("tiles of " + std::to_string(have) + " px are resized to " + std::to_string(need) +
                                " px (bicubic, antialiased, as the encoder's transform)",
                            {{"store", dir}});
    }
    stores.push_back(std::move(r));
  }
  auto resizer_for = [&](int64_t tile_px) -> const BicubicResizer* {
    auto it = resizers.find(tile_px);
    return it == resizers.end() ? nullptr : it->second.get();
  };
  // The slides to embed, and their bag names (which must not collide).
  const std::set<std::string> wanted(opt.slide_ids.begin(), opt.slide_ids.end());
  std::set<std::string> found;
  std::map<std::string, std::string> bag_owner;  // file name -> slide id
  std::vector<SlideJob> jobs;
  for (size_t s = 0; s < stores.size(); ++s) {
    for (const auto& rec : stores[s]->slides()) {
      if (!wanted.empty() && wanted.count(rec.slide_id) == 0) continue;
      found.insert(rec.slide_id);
      const std::string file = slide::cache::bag_file_name(rec.slide_id);
      auto [it, fresh] = bag_owner.emplace(file, rec.slide_id);
      if (!fresh)
        return invalid_argument("slides '" + it->second + "' and '" + rec.slide_id + "' (store " + opt.stores[s] +
                                ") would both be written to " + file + ": slide ids must be unique across the stores");
      jobs.push_back({s, rec});
    }
  }
  for (const auto& id : wanted) {
    if (found.count(id) == 0) return invalid_argument("slide '" + id + "' is in none of the stores");
  }
  if (opt.layout != "flat" && opt.layout != "clam")
    return invalid_argument("layout '" + opt.layout + "' is not one of flat, clam");
  const bool clam = opt.layout == "clam";
  const std::string bag_dir = bag_directory(opt);
  SLIDE_RETURN_IF_ERROR_CTX(slide::core::make_dirs(bag_dir), "--out");
  // A slide's bag: <bag dir>/<bag_file_name(id)>, or a complete bag of an earlier version under the
  // legacy name when it holds this slide (its slide_id attribute), so that a rerun skips it.
  auto bag_path_of = [&](const std::string& slide_id) {
    const std::string path = bag_dir + "/" + slide::cache::bag_file_name(slide_id);
    const std::string legacy = bag_dir + "/" + slide::cache::legacy_bag_file_name(slide_id);
    std::error_code ec;
    if (legacy == path || std::filesystem::exists(path, ec) || !std::filesystem::exists(legacy, ec)) return path;
    auto r = slide::cache::BagReader::open(legacy);
    return r.ok() && (*r)->info().attributes.slide_id == slide_id ? legacy : path;
  };

  // torchvision's normalisation as a lookup table per channel: (v / 255 - mean) / std.
  float lut[3][256];
  for (int c = 0; c < 3; ++c)
    for (int v = 0; v < 256; ++v)
      lut[c][v] = (static_cast<float>(v) / 255.f - extractor.mean()[c]) / extractor.std()[c];

  EmbedSummary summary;
  int64_t total_tiles = 0;
  for (const auto& j : jobs) {
    // Complete bags are skipped without work: they are not in the progress total (tiles/s).
    std::error_code ec;
    if (!std::filesystem::exists(bag_path_of(j.record.slide_id), ec)) {
      total_tiles += static_cast<int64_t>(j.record.tile_count);
    }
  }
  slide::core::Progress progress("embedding", total_tiles, "tiles/s", opt.progress);
  slide::core::ThreadPool pool(static_cast<size_t>(std::max(1, opt.decode_threads)));
  const int64_t D = extractor.feature_dim();
  std::vector<float> features;

  // Pass 1: complete bags (checked), zero-tile slides; the rest is embedded in pass 2.
  std::vector<SlideOutcome> outcomes(jobs.size());
  std::vector<size_t> todo;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const SlideJob& job = jobs[j];
    const slide::tile::SlideRecord& rec = job.record;
    SlideOutcome& o = outcomes[j];
    o.store = opt.stores[job.store];
    o.slide_id = rec.slide_id;
    o.bag_path = bag_path_of(rec.slide_id);
    std::error_code ec;
    if (std::filesystem::exists(o.bag_path, ec)) {
      // Complete by construction; reused only when made the same way.
      auto existing = slide::cache::BagReader::open(o.bag_path);
      if (!existing.ok()) {
        o.status = existing.status().with_context("existing bag (remove it to redo the slide)");
      } else {
        const auto& info = (*existing)->info();
        const auto& a = info.attributes;
        const int64_t tile_px = stores[job.store]->meta().tile_size_px;
        const int32_t want_input = resizer_for(tile_px) != nullptr ? static_cast<int32_t>(need) : 0;
        const int32_t had_input = a.encoder_input_px;
        // A bag from before attention_heads was recorded (0) is taken as made with this run's heads.
        const bool heads_mismatch = a.attention_heads > 0 && a.attention_heads != model.attention_heads;
        // The store's tiles too: a slide tiled again into another store (another tile size, tissue
        // threshold or resolution) under the same slide id has other tiles than the bag's rows.
        const auto want_tiles = static_cast<int64_t>(rec.tile_count);
        if (info.num_tiles != want_tiles || a.tile_size_px != tile_px) {
          o.status = slide::core::failed_precondition(
              "bag " + o.bag_path + " exists but holds " + std::to_string(info.num_tiles) + " tiles of " +
              std::to_string(a.tile_size_px) + " px, and store " + o.store + " has " + std::to_string(want_tiles) +
              " tiles of " + std::to_string(tile_px) + " px for this slide (tiled again?): remove the bag or write "
              "to another --out");
        } else if (a.model != model.model || a.layer != extractor.layer() || a.weights_sha256 != model.weights_sha256 ||
            info.dtype != opt.bag.dtype || info.feature_dim != D || had_input != want_input ||
            a.stain_normalization != stain_json || a.precision != precision_attr || heads_mismatch) {
          auto input = [](int32_t px) { return px > 0 ? ", tiles resized to " + std::to_string(px) + " px" : std::string(); };
          // ", <label> <value>" (`unset` for an empty one), named only when either side has a value
          // (the message stays as it was for runs without).
          auto part = [](const std::string& was, const std::string& now, const std::string& label,
                         const std::string& unset) {
            const bool any = !was.empty() || !now.empty();
            return [=](const std::string& v) { return any ? ", " + label + " " + (v.empty() ? unset : v) : std::string(); };
          };
          const auto stain = part(a.stain_normalization, stain_json, "stain normalisation", "none");
          const auto precision = part(a.precision, precision_attr, "precision", "fp32");
          // Named only when both are ViTs' and differ (the message stays as it was for the others).
          const bool heads_differ = heads_mismatch && model.attention_heads > 0;
          auto heads = [&](int32_t h) {
            return heads_differ ? ", " + std::to_string(h) + " attention heads" : std::string();
          };
          o.status = slide::core::failed_precondition(
              "bag " + o.bag_path + " exists but was made with model " + a.model + ", layer " + a.layer + ", " +
              slide::cache::feature_dtype_name(info.dtype) + ", weights " + a.weights_sha256.substr(0, 12) +
              input(had_input) + stain(a.stain_normalization) + precision(a.precision) + heads(a.attention_heads) +
              " (this run: " + model.model + ", layer " + extractor.layer() + input(want_input) + stain(stain_json) +
              precision(precision_attr) + heads(model.attention_heads) + "): remove it or write to another --out");
        } else {
          o.skipped = true;
          o.tiles = info.num_tiles;
        }
      }
      if (!o.status.ok()) slide::core::log_error(o.status.message(), {{"slide", rec.slide_id}});
    } else if (rec.tile_count == 0) {
      slide::core::log_warn("slide has zero tiles", {{"slide", rec.slide_id}, {"store", o.store}, {"bag", "none written"}});
    } else {
      todo.push_back(j);
    }
  }

  // Pass 2: the tiles of every slide to do, in order, in batches that may span slides (a store of
  // small slides or of patches still runs full batches), decoded one batch ahead of the forward
  // pass. Each slide's bag is created with its first rows and committed after its last
  // row; a tile that fails fails its slide alone (its bag is discarded, its other rows dropped).
  struct Open {
    std::unique_ptr<slide::cache::BagWriter> writer;
    int64_t appended = 0;
    bool failed = false;
    clock::time_point start;
  };
  std::map<size_t, Open> open;  // by job index
  auto fail_slide = [&](size_t j, const Status& s) {
    Open& op = open[j];
    if (op.failed) return;
    op.failed = true;
    if (op.writer) op.writer->discard();
    op.writer.reset();
    outcomes[j].status = s;
    outcomes[j].tiles = 0;
    slide::core::log_error(s.to_string(), {{"slide", outcomes[j].slide_id}, {"store", outcomes[j].store}});
  };
  // A bag write that runs out of space (disk full, quota, file size limit) stops the run: every
  // later bag would fail the same way.
  Status out_of_space;
  auto note_space = [&](const Status& s) {
    if (s.code() == slide::core::StatusCode::kResourceExhausted && out_of_space.ok()) out_of_space = s;
  };
  auto start_slide = [&](size_t j) {
    const SlideJob& job = jobs[j];
    const slide::tile::SlideRecord& rec = job.record;
    const int64_t S = stores[job.store]->meta().tile_size_px;
    slide::cache::BagAttributes attrs;
    attrs.slide_id = rec.slide_id;
    attrs.label = rec.label;
    attrs.tile_size_px = static_cast<int32_t>(S);
    attrs.mpp_um = rec.tile_mpp_um;
    attrs.tile_size_l0_px = slide::tile::tile_size_level0_px(rec, S);
    // /coords: CLAM's patch_level and patch_size (the tile's side at the level read) with --layout
    // clam, TRIDENT's otherwise; TRIDENT's magnifications (10 / mpp: 0.25 um/px is 40x) and size.
    if (clam) {
      attrs.patch_level = rec.level;
      attrs.patch_size = static_cast<int32_t>(std::lround(attrs.tile_size_l0_px / std::max(1.0, rec.downsample)));
    }
    if (rec.source_mpp_um > 0) attrs.level0_magnification = static_cast<int32_t>(std::lround(10.0 / rec.source_mpp_um));
    if (rec.tile_mpp_um > 0) attrs.target_magnification = static_cast<int32_t>(std::lround(10.0 / rec.tile_mpp_um));
    attrs.level0_width = rec.width_l0, attrs.level0_height = rec.height_l0;
    attrs.model = model.model;
    attrs.layer = extractor.layer();
    attrs.weights_sha256 = model.weights_sha256;
    attrs.tool_version = opt.tool_version;
    // Tiles resized to the encoder's input: recorded beside tile_size_px (the stored tiles' side).
    if (resizer_for(S) != nullptr) attrs.encoder_input_px = static_cast<int32_t>(need);
    attrs.stain_normalization = stain_json;
    attrs.precision = precision_attr;
    attrs.attention_heads = model.attention_heads;
    Open& op = open[j];
    op.start = clock::now();
    // Chunks no larger than the bag: a 20-tile bag is not padded to a 256-row chunk on disk.
    slide::cache::BagWriterOptions bag_options = opt.bag;
    bag_options.chunk_rows = std::clamp<int64_t>(static_cast<int64_t>(rec.tile_count), 1, opt.bag.chunk_rows);
    auto w = slide::cache::BagWriter::create(outcomes[j].bag_path, D, attrs, bag_options);
    if (!w.ok()) {
      note_space(w.status());
      return fail_slide(j, w.status());
    }
    op.writer = std::move(*w);
  };

  struct Item {
    size_t job;
    int64_t tile;  // offset in the slide
  };
  struct Batch {
    int64_t n = 0, S = 0, E = 0;  // tiles, their stored side, the side of `images` (the encoder's)
    std::vector<Item> items;
    std::vector<float> images;
    std::vector<int64_t> coords;
    std::vector<std::future<Status>> pending;
    std::vector<Status> statuses;
    void wait() {
      statuses.clear();
      for (auto& f : pending) statuses.push_back(f.get());
      pending.clear();
    }
  };
  Batch bufs[2];
  struct Drain {  // every decode task finishes before the buffers go away, whatever happens
    Batch* b;
    ~Drain() {
      b[0].wait();
      b[1].wait();
    }
  } drain{bufs};
  size_t cur_slide = 0;  // cursor into todo
  int64_t cur_tile = 0;
  // Fills `b` with up to opt.batch tiles of one tile size from the cursor and queues their decode.
  auto launch = [&](Batch& b) {
    b.items.clear();
    b.n = 0;
    b.S = 0;
    while (cur_slide < todo.size() && static_cast<int64_t>(b.items.size()) < opt.batch) {
      const size_t j = todo[cur_slide];
      const int64_t S = stores[jobs[j].store]->meta().tile_size_px;
      if (b.S != 0 && S != b.S) break;  // one tile size per batch
      if (open[j].failed) {
        ++cur_slide, cur_tile = 0;
        continue;
      }
      b.S = S;
      const int64_t take = std::min(opt.batch - static_cast<int64_t>(b.items.size()),
                                    static_cast<int64_t>(jobs[j].record.tile_count) - cur_tile);
      for (int64_t i = 0; i < take; ++i) b.items.push_back({j, cur_tile + i});
      cur_tile += take;
      if (cur_tile == static_cast<int64_t>(jobs[j].record.tile_count)) ++cur_slide, cur_tile = 0;
    }
    b.n = static_cast<int64_t>(b.items.size());
    const int64_t S = b.S;
    const BicubicResizer* resizer = resizer_for(S);
    const int64_t E = resizer != nullptr ? resizer->out_w() : S;
    b.E = E;
    b.images.resize(static_cast<size_t>(b.n * 3 * E * E));
    b.coords.resize(static_cast<size_t>(b.n * 2));
    for (int64_t i = 0; i < b.n; ++i) {
      const SlideJob& job = jobs[b.items[i].job];
      const slide::tile::StoreReader* store = stores[job.store].get();
      const std::string* dir = &opt.stores[job.store];
      const uint64_t index = job.record.first_tile_index + static_cast<uint64_t>(b.items[i].tile);
      const uint32_t slide_index = job.record.index;
      float* dst = b.images.data() + i * 3 * E * E;
      int64_t* xy = b.coords.data() + 2 * i;
      // No exception leaves a task: one reaching future::get would unwind through Drain, whose
      // wait() would rethrow the other buffer's (std::terminate). It fails the tile's slide instead.
      b.pending.push_back(pool.submit([store, dir, slide_index, index, S, &opt, resizer, &lut, dst, xy]() -> Status {
        try {
          return decode_into(*store, *dir, slide_index, index, S, opt.stain, resizer, lut, dst, xy);
        } catch (const std::bad_alloc&) {
          return slide::core::resource_exhausted("store " + *dir + ": tile " + std::to_string(index) +
                                                 ": out of host memory while decoding");
        } catch (const std::exception& e) {
          return slide::core::internal_error("store " + *dir + ": tile " + std::to_string(index) + ": " + e.what());
        }
      }));
    }
  };

  // Tiles per forward pass: the batch, or options.micro_batch; halved on out of memory.
  summary.micro_batch = opt.micro_batch > 0 ? std::min(opt.micro_batch, opt.batch) : opt.batch;
  int which = 0;
  launch(bufs[0]);
  while (bufs[which].n > 0) {
    Batch& b = bufs[which];
    b.wait();
    launch(bufs[1 - which]);  // decode the next batch while this one computes
    for (int64_t i = 0; i < b.n; ++i) {
      if (!b.statuses[i].ok()) fail_slide(b.items[i].job, b.statuses[i]);
    }
    features.resize(static_cast<size_t>(b.n * D));
    Status st = extract_in_micro_batches(extractor, b.images.data(), b.n, b.E, b.E, features.data(),
                                         &summary.micro_batch, &summary.oom_reruns);
    if (!st.ok()) {
      for (const Item& it : b.items) fail_slide(it.job, st);
    }
    // Append each slide's run of rows; commit the slides whose last row this was.
    for (int64_t i = 0; i < b.n;) {
      const size_t j = b.items[i].job;
      int64_t k = i;
      while (k < b.n && b.items[k].job == j) ++k;
      Open& op = open[j];
      // The bag is created with its first rows, not when its first tile is queued: a batch of 600
      // one-tile slides (a patch store) would otherwise hold 1,200 HDF5 files open (this batch's and
      // the next's), past a 1,024-descriptor limit.
      if (!op.failed && !op.writer) start_slide(j);
      if (!op.failed) {
        Status s = op.writer->append(k - i, std::span<const float>(features.data() + i * D, static_cast<size_t>((k - i) * D)),
                                     std::span<const int64_t>(b.coords.data() + 2 * i, static_cast<size_t>((k - i) * 2)));
        if (s.ok()) {
          op.appended += k - i;
          if (op.appended == static_cast<int64_t>(jobs[j].record.tile_count)) s = op.writer->commit();
        }
        if (!s.ok()) {
          note_space(s);
          fail_slide(j, s);
        } else if (op.appended == static_cast<int64_t>(jobs[j].record.tile_count)) {
          outcomes[j].tiles = op.appended;
          outcomes[j].seconds = std::chrono::duration<double>(clock::now() - op.start).count();
          summary.tiles_embedded += op.appended;
          slide::core::log_debug("bag written",
                                 {{"slide", outcomes[j].slide_id}, {"tiles", op.appended}, {"path", outcomes[j].bag_path}});
          open.erase(j);
        }
      }
      i = k;
    }
    progress.add(b.n);
    if (!out_of_space.ok()) break;
    if (opt.cancel != nullptr && opt.cancel->load()) {
      summary.interrupted = true;
      break;
    }
    which = 1 - which;
  }
  // Bags still open (interrupted, or failed) are discarded; an interrupted slide is not a failure.
  for (auto& [j, op] : open) {
    if (op.writer) op.writer->discard();
    if (summary.interrupted && !op.failed) {
      outcomes[j].status = slide::core::cancelled("interrupted: bag discarded");
      outcomes[j].tiles = 0;
    }
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    // Slides never reached after an interruption are left out of the summary.
    const bool reached = outcomes[j].skipped || !outcomes[j].status.ok() || outcomes[j].tiles > 0 ||
                         jobs[j].record.tile_count == 0;
    if (reached) summary.slides.push_back(outcomes[j]);
  }
  progress.finish();

  std::vector<slide::core::Status> bad;
  SLIDE_ASSIGN_OR_RETURN(auto bags, slide::cache::list_bags(bag_dir, true, &bad));
  for (const auto& s : bad) slide::core::log_warn("not a readable bag, left out of bags.csv: " + s.message());
  Status manifest = slide::cache::write_manifest(bag_dir, bags);
  if (manifest.ok() && clam) {
    // CLAM's dataset CSV (case_id, slide_id, label), its slide_id the bag's file stem.
    std::string csv = "case_id,slide_id,label\n";
    for (const auto& b : bags)
      csv += slide::core::csv_quote(b.attributes.slide_id) + "," +
             slide::core::csv_quote(std::filesystem::path(b.path).stem().string()) + "," +
             slide::core::csv_quote(b.attributes.label) + "\n";
    manifest = slide::core::write_file_atomic(opt.out_dir + "/dataset.csv", csv);
  }
  if (!out_of_space.ok()) {
    if (!manifest.ok()) slide::core::log_warn("bags.csv not written: " + manifest.to_string());
    return out_of_space.with_context("stopped: no space left for bags in " + opt.out_dir +
                                     " (complete bags are kept; free space and rerun to finish)");
  }
  SLIDE_RETURN_IF_ERROR_CTX(manifest, "bags.csv");
  summary.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return summary;
}

}  // namespace slide::train
