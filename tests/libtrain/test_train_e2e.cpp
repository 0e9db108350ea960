// End to end on real histology: the LC25000 lung subset in sample_data (3 classes x 120 JPEGs)
// tiled by libtile into a store at 32 px, split by slide (each patch is its own slide), a small
// CNN trained on the cpu (oneDNN) backend for a few epochs. Validation accuracy must be far above
// chance (1/3). LC25000's near-duplicates make its accuracies optimistic; this test shows the
// engine learns real images, it is not a benchmark.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "slide/core/file.h"
#include "slide/tile/pipeline.h"
#include "slide/train/layers.h"
#include "slide/train/trainer.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_train_e2e {

using namespace slide::train;

namespace {

template <typename T>
std::unique_ptr<Layer> take(Result<std::unique_ptr<T>> r) {
  REQUIRE(r.ok());
  return std::move(*r);
}

std::string temp_dir() {
  std::string t = (std::filesystem::temp_directory_path() / "slide_train_e2e_XXXXXX").string();
  REQUIRE(mkdtemp(t.data()) != nullptr);
  return t;
}

// The LC25000 lung subset tiled at 16 px into `store`, opened.
std::unique_ptr<TileDataset> lc16(const std::string& store) {
  auto inputs = slide::tile::collect_inputs({}, {}, {std::string(SLIDE_SAMPLE_DIR) + "/patches/lc25000-lung-subset"});
  REQUIRE(inputs.ok());
  slide::tile::TileJobOptions topt;
  topt.grid.tile_size_px = 16;
  topt.progress = false;
  REQUIRE(slide::tile::run_tiling(*inputs, store, topt).ok());
  auto data = TileDataset::open({store});
  REQUIRE(data.ok());
  return std::move(*data);
}

// conv 3x3 (3 -> 6) -> ReLU -> global average pool -> linear (6 -> 3), no batch norm, into `net`.
void add_tiny_cnn(Sequential& net, InitRng& rng) {
  net.add(take(Conv2d::make(cpu_allocator(), DType::kF32, 3, 6, 3, {1, 1}, true, rng)));
  net.add(std::make_unique<ReLU>());
  net.add(std::make_unique<GlobalAvgPool>());
  net.add(take(Linear::make(cpu_allocator(), DType::kF32, 6, 3, rng)));
}

struct TinyRun {
  std::vector<float> weights;  // every parameter after the epoch, in collect order
  EpochStats stats;
  int64_t optimizer_steps = 0;
};

// One epoch of the tiny CNN (InitRng 5) over `positions` on `be`: SGD (OptimizerConfig's defaults)
// at a constant learning rate of 0.5, no augmentation, the batch, micro-batches and loss scaler of `to`.
TinyRun train_tiny(Backend& be, const TileDataset& data, const std::vector<size_t>& positions, TrainOptions to) {
  InitRng rng(5);
  Sequential net;
  add_tiny_cnn(net, rng);
  std::vector<Parameter*> params;
  net.collect("", &params, nullptr);
  auto opt = Optimizer::make(OptimizerConfig{}, params, cpu_allocator());
  REQUIRE(opt.ok());
  Schedule sched;
  sched.kind = "constant";
  sched.base_lr = 0.5;
  to.augment = {};
  auto st = train_epoch(be, net, **opt, sched, data, positions, to, 1, nullptr);
  REQUIRE_MESSAGE(st.ok(), st.status().to_string());
  TinyRun r;
  for (auto* p : params) r.weights.insert(r.weights.end(), p->value.data<float>(), p->value.data<float>() + p->value.numel());
  r.stats = *st;
  r.optimizer_steps = (*opt)->steps();
  return r;
}

}  // namespace

TEST_CASE("train e2e: a small CNN learns LC25000 lung classes from a slide-tile store") {
  const std::string dir = temp_dir(), store = dir + "/lc";
  auto inputs = slide::tile::collect_inputs({}, {}, {std::string(SLIDE_SAMPLE_DIR) + "/patches/lc25000-lung-subset"});
  REQUIRE_MESSAGE(inputs.ok(), inputs.status().to_string());
  slide::tile::TileJobOptions topt;
  topt.grid.tile_size_px = 32;
  topt.progress = false;
  auto summary = slide::tile::run_tiling(*inputs, store, topt);
  REQUIRE_MESSAGE(summary.ok(), summary.status().to_string());

  auto data = TileDataset::open({store});
  REQUIRE_MESSAGE(data.ok(), data.status().to_string());
  CHECK((*data)->class_names() == std::vector<std::string>{"lung_aca", "lung_n", "lung_scc"});
  CHECK((*data)->tiles().size() == 360);
  std::vector<size_t> train, val;
  (*data)->split_by_slide(0.25, 7, &train, &val);
  CHECK(val.size() == 90);
  CHECK(train.size() == 270);

  {
    // A labels CSV with a patient column: 360 slides of 12 patients (slide i -> patient i % 12);
    // the split keeps each patient's slides on one side and holds out round(0.25 x 12) = 3 patients.
    std::string csv = "slide_id,label,patient\n";
    for (size_t i = 0; i < (*data)->slide_ids().size(); ++i) {
      const std::string id = (*data)->slide_ids()[i].substr(2);  // drop "0:"
      csv += id + "," + id.substr(0, id.find('/')) + ",p" + std::to_string(i % 12) + "\n";
    }
    REQUIRE(slide::core::write_file_atomic(dir + "/labels.csv", csv).ok());
    auto by_patient = TileDataset::open({store}, dir + "/labels.csv");
    REQUIRE_MESSAGE(by_patient.ok(), by_patient.status().to_string());
    std::vector<size_t> tr, va;
    (*by_patient)->split_by_slide(0.25, 7, &tr, &va);
    CHECK(va.size() == 90);  // 3 patients x 30 slides x 1 tile
    std::set<size_t> val_patients, train_patients;
    for (size_t p : va) val_patients.insert((*by_patient)->tiles()[p].slide % 12);
    for (size_t p : tr) train_patients.insert((*by_patient)->tiles()[p].slide % 12);
    CHECK(val_patients.size() == 3);
    for (size_t p : val_patients) CHECK(train_patients.count(p) == 0);

    // A patients-only CSV (slide_id, patient; no label column): the same groups, the store's labels.
    std::string patients = "slide_id,patient\n";
    for (size_t i = 0; i < (*data)->slide_ids().size(); ++i)
      patients += (*data)->slide_ids()[i].substr(2) + ",p" + std::to_string(i % 12) + "\n";
    REQUIRE(slide::core::write_file_atomic(dir + "/patients.csv", patients).ok());
    auto grouped = TileDataset::open({store}, dir + "/patients.csv");
    REQUIRE_MESSAGE(grouped.ok(), grouped.status().to_string());
    CHECK((*grouped)->groups() == 12);
    CHECK((*grouped)->class_names() == (*data)->class_names());
    for (size_t i = 0; i < (*data)->tiles().size(); ++i) CHECK((*grouped)->tiles()[i].label == (*data)->tiles()[i].label);
    std::vector<size_t> gtr, gva;
    (*grouped)->split_by_slide(0.25, 7, &gtr, &gva);
    CHECK(gva == va);
    // A slide missing from it, or a CSV of neither labels nor patients, is an error naming the file.
    REQUIRE(slide::core::write_file_atomic(dir + "/some.csv", patients.substr(0, patients.rfind('\n', patients.size() - 2) + 1)).ok());
    auto missing = TileDataset::open({store}, dir + "/some.csv");
    CHECK(missing.status().message().find(dir + "/some.csv: no row for slide") != std::string::npos);
    REQUIRE(slide::core::write_file_atomic(dir + "/ids.csv", "slide_id,site\na,b\n").ok());
    auto neither = TileDataset::open({store}, dir + "/ids.csv");
    CHECK(neither.status().message().find("must name a slide_id column and a label or patient") != std::string::npos);

    // K-fold cross-validation by patient (the CSV's column also read as CLAM's case_id): over the
    // 5 folds every patient is validated exactly once and never trains in its own fold.
    std::string cases = csv;
    cases.replace(cases.find("patient"), 7, "case_id");
    REQUIRE(slide::core::write_file_atomic(dir + "/cases.csv", cases).ok());
    auto by_case = TileDataset::open({store}, dir + "/cases.csv");
    REQUIRE(by_case.ok());
    CHECK((*by_case)->groups() == 12);
    std::map<size_t, int> validated;  // patient -> folds validating it
    size_t val_tiles = 0;
    for (int k = 0; k < 5; ++k) {
      REQUIRE((*by_case)->split_fold(5, k, 7, &tr, &va).ok());
      CHECK(tr.size() + va.size() == 360);
      std::set<size_t> vp, tp;
      for (size_t p : va) vp.insert((*by_case)->tiles()[p].slide % 12);
      for (size_t p : tr) tp.insert((*by_case)->tiles()[p].slide % 12);
      for (size_t p : vp) CHECK(tp.count(p) == 0);
      for (size_t p : vp) ++validated[p];
      CHECK((vp.size() == 2 || vp.size() == 3));  // 12 patients dealt into 5 folds
      val_tiles += va.size();
    }
    CHECK(val_tiles == 360);
    CHECK(validated.size() == 12);
    for (const auto& [p, n] : validated) CHECK(n == 1);
    CHECK((*by_case)->split_fold(13, 0, 7, &tr, &va).code() == slide::core::StatusCode::kInvalidArgument);
    CHECK((*by_case)->split_fold(5, 5, 7, &tr, &va).code() == slide::core::StatusCode::kInvalidArgument);

    // A held-out test set (--test-fraction 0.25: 3 of the 12 patients): no later split touches it.
    std::vector<size_t> test;
    (*by_case)->hold_out(0.25, 7, &test);
    std::set<size_t> test_patients;
    for (size_t p : test) test_patients.insert((*by_case)->tiles()[p].slide % 12);
    CHECK(test_patients.size() == 3);
    CHECK(test.size() == 90);
    (*by_case)->split_by_slide(0.25, 7, &tr, &va);
    CHECK(tr.size() + va.size() == 270);
    std::set<size_t> seen;
    for (size_t p : tr) seen.insert((*by_case)->tiles()[p].slide % 12);
    for (size_t p : va) seen.insert((*by_case)->tiles()[p].slide % 12);
    CHECK(seen.size() == 9);
    for (size_t p : test_patients) CHECK(seen.count(p) == 0);
    for (int k = 0; k < 3; ++k) {
      REQUIRE((*by_case)->split_fold(3, k, 7, &tr, &va).ok());
      CHECK(tr.size() + va.size() == 270);
      for (size_t p : va) CHECK(test_patients.count((*by_case)->tiles()[p].slide % 12) == 0);
    }
  }

  auto be = make_backend("cpu");
  REQUIRE(be.ok());
  auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 8, 1);
  REQUIRE(model.ok());
  std::vector<Parameter*> params;
  (*model)->collect("", &params, nullptr);
  OptimizerConfig oc;
  oc.momentum = 0.9;
  oc.weight_decay = 5e-4;
  auto opt = Optimizer::make(oc, params, cpu_allocator());
  REQUIRE(opt.ok());
  TrainOptions to;
  to.batch_size = 32;
  const int epochs = 12;
  Schedule sched;
  sched.base_lr = 0.05;
  sched.warmup_steps = 9;
  sched.total_steps = epochs * 9;
  slide::core::ThreadPool pool(2);
  EpochStats last, first_val;
  for (int e = 0; e < epochs; ++e) {
    auto st = train_epoch(**be, **model, **opt, sched, **data, train, to, 100 + e, &pool);
    REQUIRE_MESSAGE(st.ok(), st.status().to_string());
    last = *st;
    if (e == 0) {
      auto v = evaluate(**be, **model, **data, val, 64, &pool);
      REQUIRE(v.ok());
      first_val = *v;
    }
  }
  auto v = evaluate(**be, **model, **data, val, 64, &pool);
  REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  MESSAGE("train loss ", last.loss, " acc ", last.accuracy, "; validation after epoch 1: acc ", first_val.accuracy,
          ", after ", epochs, ": loss ", v->loss, " acc ", v->accuracy, " balanced ", v->balanced_accuracy);
  CHECK(v->samples == 90);
  CHECK(v->accuracy > 0.7);
  CHECK(v->balanced_accuracy > 0.7);
  CHECK(last.loss < 0.8);
  std::filesystem::remove_all(dir);
}

TEST_CASE("split: a slide id in two stores is one slide (never on both sides of the split)") {
  // The same 360 patches tiled into two stores (as one slide tiled at two resolutions, or twice):
  // 360 groups, not 720, and no slide id both trains and validates.
  const std::string dir = temp_dir();
  lc16(dir + "/a");
  lc16(dir + "/b");
  auto data = TileDataset::open({dir + "/a", dir + "/b"});
  REQUIRE_MESSAGE(data.ok(), data.status().to_string());
  CHECK((*data)->tiles().size() == 720);
  CHECK((*data)->groups() == 360);
  const auto id = [&](size_t p) { return (*data)->slide_record((*data)->tiles()[p].slide).slide_id; };
  const auto check_disjoint = [&](const std::vector<size_t>& tr, const std::vector<size_t>& va) {
    std::set<std::string> train_ids, val_ids;
    for (size_t p : tr) train_ids.insert(id(p));
    for (size_t p : va) val_ids.insert(id(p));
    CHECK(val_ids.size() == va.size() / 2);  // each validation slide with its tiles of both stores
    for (const auto& v : val_ids) CHECK(train_ids.count(v) == 0);
  };
  std::vector<size_t> tr, va;
  (*data)->split_by_slide(0.25, 7, &tr, &va);
  CHECK(va.size() == 180);
  check_disjoint(tr, va);
  REQUIRE((*data)->split_fold(5, 2, 7, &tr, &va).ok());
  check_disjoint(tr, va);
  std::filesystem::remove_all(dir);
}

TEST_CASE("split: stratified by class (--stratify), each class's groups on both sides in its share") {
  // 16 groups of four classes, interleaved: 10 of class 2, 3 of class 0, 2 of class 3, 1 of class 1.
  const std::vector<int32_t> cls = {2, 0, 2, 3, 2, 2, 0, 1, 2, 2, 3, 2, 0, 2, 2, 2};
  std::map<int32_t, size_t> want_val = {{2, 2}, {0, 1}, {3, 1}, {1, 0}};  // round(0.2 n), in [1, n - 1]; a lone group trains
  std::set<std::vector<bool>> seen;
  for (uint64_t seed = 0; seed < 40; ++seed) {
    const std::vector<bool> is_val = split_groups_stratified(cls, 0.2, seed);
    REQUIRE(is_val.size() == cls.size());
    std::map<int32_t, size_t> got;
    for (size_t g = 0; g < cls.size(); ++g) got[cls[g]] += is_val[g] ? 1 : 0;
    for (const auto& want : want_val)  // (no structured binding: clang 14 will not capture one in CHECK_MESSAGE)
      CHECK_MESSAGE(got[want.first] == want.second, "class " << want.first << " seed " << seed);
    CHECK(split_groups_stratified(cls, 0.2, seed) == is_val);  // the seed decides
    seen.insert(is_val);
  }
  CHECK(seen.size() > 20);  // and does decide: the draws differ between seeds
  // Bounds: nothing at 0; at 0.9 a class of two keeps one group to train, a class of ten one too.
  CHECK(split_groups_stratified(cls, 0, 3) == std::vector<bool>(cls.size(), false));
  const std::vector<bool> most = split_groups_stratified(cls, 0.9, 3);
  std::map<int32_t, size_t> trains;
  for (size_t g = 0; g < cls.size(); ++g) trains[cls[g]] += most[g] ? 0 : 1;
  CHECK(trains == std::map<int32_t, size_t>{{0, 1}, {1, 1}, {2, 1}, {3, 1}});
  // One class: the plain split's shuffle and count (the same groups for the same seed).
  for (uint64_t seed : {1u, 7u, 99u}) CHECK(split_groups_stratified(std::vector<int32_t>(12, 4), 0.25, seed) ==
                                            split_groups(12, 0.25, seed));

  // Folds: every fold holds each class's share to one group, and fold sizes differ by one at most.
  for (uint64_t seed = 0; seed < 10; ++seed) {
    const std::vector<int> fold = fold_groups_stratified(cls, 3, seed);
    std::map<std::pair<int32_t, int>, int> per;
    std::vector<int> size(3, 0);
    for (size_t g = 0; g < cls.size(); ++g) {
      REQUIRE((fold[g] >= 0 && fold[g] < 3));
      ++per[{cls[g], fold[g]}], ++size[static_cast<size_t>(fold[g])];
    }
    for (int32_t c : {0, 1, 2, 3}) {
      int lo = 1 << 30, hi = 0;
      for (int f = 0; f < 3; ++f) lo = std::min(lo, per[{c, f}]), hi = std::max(hi, per[{c, f}]);
      CHECK_MESSAGE(hi - lo <= 1, "class " << c << " seed " << seed);
    }
    CHECK(*std::max_element(size.begin(), size.end()) - *std::min_element(size.begin(), size.end()) <= 1);
  }
  // The plain folds: dealt round-robin after one shuffle.
  const std::vector<int> plain = fold_groups(7, 3, 5);
  CHECK(std::count(plain.begin(), plain.end(), 0) == 3);
  CHECK(std::count(plain.begin(), plain.end(), 2) == 2);

  // A group's class: its items' most frequent label, the lowest on a tie; an empty group -1.
  CHECK(group_classes({0, 0, 0, 1, 1, 2, 2, 2, 2}, {1, 2, 2, 3, 0, -1, -1, 5, 1}, 4) ==
        std::vector<int32_t>{2, 0, -1, -1});
}

TEST_CASE("split: --stratify on a store: each class's slides split in its share, the test set and folds too") {
  const std::string dir = temp_dir();
  lc16(dir + "/lc");  // 360 slides of one tile, 120 of each class
  auto data = TileDataset::open({dir + "/lc"});
  REQUIRE_MESSAGE(data.ok(), data.status().to_string());
  const auto per_class = [&](const std::vector<size_t>& positions) {
    std::vector<size_t> n((*data)->class_names().size(), 0);
    for (size_t p : positions) ++n[static_cast<size_t>((*data)->tiles()[p].label)];
    return n;
  };
  std::vector<size_t> tr, va, test;
  bool plain_uneven = false;
  for (uint64_t seed : {1u, 2u, 3u}) {
    (*data)->split_by_slide(0.25, seed, &tr, &va, /*stratify=*/true);
    CHECK(per_class(va) == std::vector<size_t>{30, 30, 30});
    CHECK(per_class(tr) == std::vector<size_t>{90, 90, 90});
    (*data)->split_by_slide(0.25, seed, &tr, &va);
    CHECK(va.size() == 90);
    plain_uneven = plain_uneven || per_class(va) != std::vector<size_t>{30, 30, 30};
  }
  CHECK(plain_uneven);  // what stratifying changes
  // A stratified test set (30 of each class), then stratified folds of the rest: 18 of each class
  // validated in each of 5 folds, every slide once, none of the test set.
  (*data)->hold_out(0.25, 7, &test, /*stratify=*/true);
  CHECK(per_class(test) == std::vector<size_t>{30, 30, 30});
  const std::set<size_t> test_set(test.begin(), test.end());
  std::set<size_t> validated;
  for (int k = 0; k < 5; ++k) {
    REQUIRE((*data)->split_fold(5, k, 7, &tr, &va, /*stratify=*/true).ok());
    CHECK(per_class(va) == std::vector<size_t>{18, 18, 18});
    CHECK(tr.size() == 216);
    for (size_t p : va) CHECK((test_set.count(p) == 0 && validated.insert(p).second));
  }
  CHECK(validated.size() == 270);
  std::filesystem::remove_all(dir);
}

TEST_CASE("gradient accumulation: 3 micro-batches give the update of one batch (no batch norm)") {
  const std::string dir = temp_dir();
  auto data = lc16(dir + "/lc");
  std::vector<size_t> twelve;
  for (size_t i = 0; i < 360; i += 30) twelve.push_back(i);

  // sklearn's "balanced" weights: 160 tiles, 120 of lung_aca and 40 of lung_n, none of lung_scc.
  std::vector<size_t> first160(160);
  for (size_t i = 0; i < 160; ++i) first160[i] = i;
  auto w = balanced_class_weights(*data, first160, cpu_allocator());
  REQUIRE(w.ok());
  CHECK(w->data<float>()[0] == doctest::Approx(160.0 / 360.0));
  CHECK(w->data<float>()[1] == doctest::Approx(160.0 / 120.0));
  CHECK(w->data<float>()[2] == 0.0f);

  auto cpu = make_backend("cpu");
  REQUIRE(cpu.ok());
  // conv -> relu -> global pool -> linear: batch norm would see different statistics per
  // micro-batch (the documented exception), so it is left out here.
  auto run = [&](int64_t accumulate, bool weighted = false) {
    TrainOptions to;
    to.batch_size = 12;
    to.accumulate = accumulate;
    if (weighted) to.class_weights = *w;
    const TinyRun r = train_tiny(**cpu, *data, twelve, to);
    CHECK(r.stats.steps == 1);
    return r;
  };
  const std::vector<float> one = run(1).weights, three = run(3).weights,
                           five = run(5).weights;  // 5: micro-batches of 2 and 3
  REQUIRE(one.size() == three.size());
  double worst3 = 0, worst5 = 0, moved = 0;
  InitRng rng(5);
  for (size_t i = 0; i < one.size(); ++i) {
    worst3 = std::max(worst3, double(std::abs(one[i] - three[i])));
    worst5 = std::max(worst5, double(std::abs(one[i] - five[i])));
  }
  // With class weights the loss is the weighted mean over the whole step (PyTorch's
  // CrossEntropyLoss(weight)): each micro-batch's gradient counts by its share of the step's weight,
  // not of its samples (here lung_scc weighs 0, so micro-batches of equal size weigh differently).
  {
    const TinyRun w1 = run(1, true), w3 = run(3, true), w5 = run(5, true);
    double worst_w3 = 0, worst_w5 = 0, unweighted = 0;
    for (size_t i = 0; i < one.size(); ++i) {
      worst_w3 = std::max(worst_w3, double(std::abs(w1.weights[i] - w3.weights[i])));
      worst_w5 = std::max(worst_w5, double(std::abs(w1.weights[i] - w5.weights[i])));
      unweighted = std::max(unweighted, double(std::abs(w1.weights[i] - one[i])));
    }
    CHECK(unweighted > 1e-4);  // the weights changed the update
    CHECK(worst_w3 < 1e-5);
    CHECK(worst_w5 < 1e-5);
    // The epoch's reported loss does not depend on the split either.
    CHECK(w3.stats.loss == doctest::Approx(w1.stats.loss).epsilon(1e-5));
    CHECK(w5.stats.loss == doctest::Approx(w1.stats.loss).epsilon(1e-5));
  }
  // The step moved the weights (so equality is not vacuous): compare with a fresh initialisation.
  Sequential fresh;
  fresh.add(take(Conv2d::make(cpu_allocator(), DType::kF32, 3, 6, 3, {1, 1}, true, rng)));
  std::vector<Parameter*> fp;
  fresh.collect("", &fp, nullptr);
  for (int64_t i = 0; i < fp[0]->value.numel(); ++i) moved = std::max(moved, double(std::abs(fp[0]->value.data<float>()[i] - one[static_cast<size_t>(i)])));
  CHECK(moved > 1e-4);
  CHECK(worst3 < 1e-5);
  CHECK(worst5 < 1e-5);

  // Issue 20: a non-finite loss (here from a NaN weight) stops the epoch before the update.
  {
    InitRng nan_rng(5);
    Sequential net;
    add_tiny_cnn(net, nan_rng);
    std::vector<Parameter*> params;
    net.collect("", &params, nullptr);
    params.back()->value.data<float>()[0] = std::nanf("");
    const float conv0 = params[0]->value.data<float>()[0];
    auto opt = Optimizer::make(OptimizerConfig{}, params, cpu_allocator());
    REQUIRE(opt.ok());
    Schedule sched;
    sched.kind = "constant";
    TrainOptions to;
    to.batch_size = 6;
    to.augment = {};
    auto st = train_epoch(**cpu, net, **opt, sched, *data, twelve, to, 1, nullptr);
    REQUIRE(!st.ok());
    CHECK(st.status().code() == slide::core::StatusCode::kOutOfRange);
    CHECK(st.status().message().find("step 0 of the epoch (optimizer step 1): the loss is nan") != std::string::npos);
    CHECK((*opt)->steps() == 0);
    CHECK(params[0]->value.data<float>()[0] == conv0);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("loss scaling: a power-of-two scale at fp32 changes no bit; under fp16 an overflowing step is skipped") {
  const std::string dir = temp_dir();
  auto data = lc16(dir + "/lc");
  std::vector<size_t> twelve;
  for (size_t i = 0; i < 360; i += 30) twelve.push_back(i);
  // Two steps of 6 (two micro-batches each) of the tiny CNN on `backend`.
  auto run = [&](const char* backend, MathPrecision precision, LossScaler* scaler) {
    auto be = make_backend(backend);
    REQUIRE(be.ok());
    REQUIRE((*be)->set_math_precision(precision).ok());
    TrainOptions to;
    to.batch_size = 6;
    to.accumulate = 2;
    to.loss_scaler = scaler;
    return train_tiny(**be, *data, twelve, to);
  };
  // fp32: scaling by 2^16 and back is exact, so the weights are the unscaled run's bit for bit.
  auto scaler = LossScaler::make({});
  REQUIRE(scaler.ok());
  const TinyRun plain = run("cpu", MathPrecision::kFp32, nullptr), scaled = run("cpu", MathPrecision::kFp32, &*scaler);
  CHECK(plain.weights == scaled.weights);
  CHECK(scaled.stats.skipped_steps == 0);
  CHECK(scaler->scale() == 65536.0);
  CHECK(scaler->growth_tracker() == 2);
  // fp16 on the reference backend (operands rounded to f16 exactly) with a scale of 2^40: the
  // scaled loss gradient overflows f16 in backward, both steps are skipped (the weights stay the
  // initial ones, the optimizer never steps) and the scale is halved twice.
  LossScalerOptions huge;
  huge.init_scale = 0x1p40;
  auto big = LossScaler::make(huge);
  REQUIRE(big.ok());
  const TinyRun skipped = run("reference", MathPrecision::kFp16, &*big);
  CHECK(skipped.stats.skipped_steps == 2);
  CHECK(skipped.stats.steps == 2);
  CHECK(skipped.optimizer_steps == 0);
  CHECK(big->scale() == 0x1p38);
  CHECK(big->skipped_steps() == 2);
  InitRng rng(5);
  Sequential fresh;
  add_tiny_cnn(fresh, rng);
  std::vector<Parameter*> fp;
  fresh.collect("", &fp, nullptr);
  std::vector<float> initial;
  for (auto* p : fp) initial.insert(initial.end(), p->value.data<float>(), p->value.data<float>() + p->value.numel());
  CHECK(skipped.weights == initial);
  CHECK(plain.weights != initial);  // the fp32 runs did move
  // The same fp16 run with GradScaler's 2^16 steps both times.
  auto normal = LossScaler::make({});
  REQUIRE(normal.ok());
  const TinyRun fp16 = run("reference", MathPrecision::kFp16, &*normal);
  CHECK(fp16.stats.skipped_steps == 0);
  CHECK(fp16.optimizer_steps == 2);
  std::filesystem::remove_all(dir);
}

}  // namespace libtrain_test_train_e2e
