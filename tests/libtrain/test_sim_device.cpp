// The device paths of training, evaluation and checkpoints, without a GPU: the reference backend
// on the simulated device (`reference-sim`, Device::kSim) keeps every tensor in memory that host
// code may not read (Tensor::data ends the process), so a trainer that touched a device tensor on
// the host would die here instead of on a GPU. Each run is compared bit for bit with the same run
// on the plain reference backend: the device paths (upload, download, the loss scale on the
// backend, device zeroing, checkpoint transfers) change no number. On real LC25000 lung tiles
// from sample_data, tiled by libtile at 16 px.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "slide/tile/pipeline.h"
#include "../../libtrain/src/batch_uploader.h"
#include "slide/train/checkpoint.h"
#include "slide/train/copy_engine.h"
#include "slide/train/trainer.h"
#include "test_fixtures.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_sim_device {

using namespace slide::train;

TEST_SUITE_BEGIN("sim_device");

namespace {

const TileDataset& lung() {
  static std::unique_ptr<TileDataset> data = testing::tile_lc25000(16, "sim_device");
  return *data;
}

std::unique_ptr<Backend> backend(const std::string& name) {
  auto r = make_backend(name);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  return std::move(*r);
}

// Every parameter and buffer of `model` in host memory, in collect() order.
std::vector<std::vector<float>> state_of(Backend& be, Layer& model) {
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  model.collect("", &params, &buffers);
  std::vector<std::vector<float>> out;
  auto add = [&](const Tensor& t) {
    auto h = to_host(be, t);
    REQUIRE_MESSAGE(h.ok(), h.status().to_string());
    out.emplace_back(h->data<float>(), h->data<float>() + h->numel());
  };
  for (auto* p : params) add(p->value);
  for (auto* b : buffers) add(b->value);
  return out;
}

struct RunResult {
  std::vector<EpochStats> epochs;
  EpochStats val;
  std::vector<float> val_probs;
  std::vector<std::vector<float>> state;
};

// Two epochs of the small CNN (batch norm, dropout before fc) with SGD momentum, label smoothing,
// class weights and 2 micro-batches per step, then an evaluation: on `be`, whose device the model
// and optimizer state are moved to as the app does. `budget` (bytes above what is live once the
// model is built) limits be's allocator.
RunResult train_run(Backend& be, size_t budget = Allocator::kUnlimited, int64_t accumulate = 2,
                    const TileDataset& data = lung(), bool jitter_and_crop = false) {
  auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 8, 5, 0.25);
  REQUIRE(model.ok());
  REQUIRE((*model)->size() > 0);
  const Status moved = move_to_device(be, **model);
  REQUIRE_MESSAGE(moved.ok(), moved.to_string());
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*model)->collect("", &params, &buffers);
  for (auto* p : params) CHECK(p->value.device() == be.device());
  for (auto* b : buffers) CHECK(b->value.device() == be.device());
  OptimizerConfig oc;
  oc.momentum = 0.9;
  oc.weight_decay = 1e-4;
  auto opt = Optimizer::make(oc, params, be.allocator());
  REQUIRE(opt.ok());
  std::vector<size_t> train, val;
  for (size_t i = 0; i < data.tiles().size(); ++i) (i % 5 == 0 ? val : train).push_back(i);
  train.resize(96);
  auto weights = balanced_weights({0, 1, 1, 2, 2, 2}, 3, cpu_allocator());  // host weights, as the app makes them
  REQUIRE(weights.ok());
  TrainOptions to;
  to.batch_size = 24;
  to.accumulate = accumulate;
  to.label_smoothing = 0.1;
  to.class_weights = *weights;
  to.augment.flips_rotations = true;
  to.augment.brightness = 0.2f;
  if (jitter_and_crop) {
    to.augment.contrast = 0.3f, to.augment.saturation = 0.3f, to.augment.hue = 0.1f;
    to.augment.crop_min_scale = 0.5f;
  }
  Schedule sched;
  sched.base_lr = 0.05;
  sched.total_steps = 8;
  slide::core::ThreadPool pool(2);
  RunResult r;
  const size_t live = be.allocator().current_bytes();
  if (budget != Allocator::kUnlimited) be.allocator().set_budget_bytes(live + budget);
  for (int e = 0; e < 2; ++e) {
    auto st = train_epoch(be, **model, **opt, sched, data, train, to, 40 + static_cast<uint64_t>(e), &pool);
    REQUIRE_MESSAGE(st.ok(), st.status().to_string());
    r.epochs.push_back(*st);
  }
  be.allocator().set_budget_bytes(Allocator::kUnlimited);
  auto v = evaluate(be, **model, data, val, 32, &pool, &r.val_probs);
  REQUIRE_MESSAGE(v.ok(), v.status().to_string());
  r.val = *v;
  r.state = state_of(be, **model);
  return r;
}

void check_same(const RunResult& a, const RunResult& b) {
  REQUIRE(a.epochs.size() == b.epochs.size());
  for (size_t e = 0; e < a.epochs.size(); ++e) {
    CHECK(a.epochs[e].loss == b.epochs[e].loss);
    CHECK(a.epochs[e].accuracy == b.epochs[e].accuracy);
    CHECK(a.epochs[e].samples == b.epochs[e].samples);
  }
  CHECK(a.val.loss == b.val.loss);
  CHECK(a.val.balanced_accuracy == b.val.balanced_accuracy);
  CHECK(a.val_probs == b.val_probs);
  REQUIRE(a.state.size() == b.state.size());
  for (size_t i = 0; i < a.state.size(); ++i) CHECK(a.state[i] == b.state[i]);
}

}  // namespace

TEST_CASE("sim device: host code reading a device tensor's elements ends the process, naming it") {
  auto t = Tensor::zeros({2, 3}, DType::kF32, sim_device_allocator(), "t");
  REQUIRE(t.ok());
  CHECK(t->device() == Device::kSim);
  CHECK(std::string(device_name(t->device())) == "sim");
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::signal(SIGABRT, SIG_DFL);  // not doctest's crash report: the plain abort is the expected end
    dup2(fds[1], STDERR_FILENO);
    volatile float v = t->data<float>()[0];  // must not return
    (void)v;
    _exit(0);
  }
  close(fds[1]);
  std::string err;  // all the child wrote, to its end (one read may return part of it)
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) err.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
  CHECK(err.find("f32 tensor [2, 3] on sim") != std::string::npos);
  CHECK(err.find("Backend::download") != std::string::npos);
}

TEST_CASE("sim device: transfers, set_zero, copy_from, and the checks on the wrong device") {
  auto be = backend("reference-sim");
  CHECK(be->name() == "reference-sim");
  CHECK(be->device() == Device::kSim);
  auto h = Tensor::empty({4}, DType::kF32, cpu_allocator(), "h");
  REQUIRE(h.ok());
  for (int i = 0; i < 4; ++i) h->data<float>()[i] = static_cast<float>(i) + 0.5f;
  auto d = to_device(*be, *h, "d");
  REQUIRE(d.ok());
  CHECK(d->device() == Device::kSim);
  CHECK(!d->shares_storage(*h));
  auto c = d->clone();
  REQUIRE(c.ok());
  CHECK(c->device() == Device::kSim);
  REQUIRE(d->set_zero().ok());
  auto back = to_host(*be, *c);
  REQUIRE(back.ok());
  CHECK(back->data<float>()[3] == 3.5f);
  REQUIRE(c->copy_from(*d).ok());  // zeros
  back = to_host(*be, *c);
  REQUIRE(back.ok());
  CHECK(back->data<float>()[3] == 0.0f);
  CHECK(c->copy_from(*h).code() == slide::core::StatusCode::kInvalidArgument);  // host into device
  // An op given a host tensor on the device backend is refused, naming both devices.
  auto y = Tensor::empty({4}, DType::kF32, sim_device_allocator(), "y");
  REQUIRE(y.ok());
  const Status s = be->relu_forward(*h, *y);
  CHECK(s.code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(s.to_string().find("is on cpu") != std::string::npos);
  // A host backend: to_device and to_host are the tensor itself.
  auto ref = backend("reference");
  auto same = to_device(*ref, *h);
  REQUIRE(same.ok());
  CHECK(same->shares_storage(*h));
}

TEST_CASE("sim device: the optimizer's gradient check runs on the device and names the non-finite gradient") {
  auto sim = backend("reference-sim");
  auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 4, 2);
  REQUIRE(model.ok());
  std::vector<Parameter*> params;
  (*model)->collect("", &params, nullptr);
  // One gradient with a NaN, set on the host before the move (host code may not write it after).
  Parameter* bad = params[2];
  bad->grad.data<float>()[1] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE(move_to_device(*sim, **model).ok());
  auto opt = Optimizer::make(OptimizerConfig{}, params, sim->allocator());
  REQUIRE(opt.ok());
  const auto before = state_of(*sim, **model);
  const Status s = (*opt)->step(*sim, 0.1);
  CHECK(s.code() == slide::core::StatusCode::kOutOfRange);
  CHECK(s.to_string().find("first in " + bad->name + "'s gradient") != std::string::npos);
  CHECK(state_of(*sim, **model) == before);  // nothing was updated
  CHECK((*opt)->steps() == 0);
  // The same check on every host backend: one sum, in double.
  auto h = Tensor::empty({7}, DType::kF32, cpu_allocator(), "h");
  REQUIRE(h.ok());
  for (int i = 0; i < 7; ++i) h->data<float>()[i] = 0.5f * static_cast<float>(i) - 1.0f;
  auto d = to_device(*sim, *h);
  REQUIRE(d.ok());
  double ref = 0, cpu = 0, dev = 0;
  REQUIRE(backend("reference")->sum_of_squares(*h, &ref).ok());
  REQUIRE(backend("cpu")->sum_of_squares(*h, &cpu).ok());
  REQUIRE(sim->sum_of_squares(*d, &dev).ok());
  CHECK(ref == 1 + 0.25 + 0 + 0.25 + 1 + 2.25 + 4);
  CHECK(cpu == ref);
  CHECK(dev == ref);
}

TEST_CASE("sim device: two epochs of training and an evaluation equal the host run bit for bit") {
  auto host = backend("reference");
  auto sim = backend("reference-sim");
  const RunResult a = train_run(*host);
  const RunResult b = train_run(*sim);
  check_same(a, b);
  CHECK(a.epochs[1].loss < a.epochs[0].loss * 1.5);  // it trained (and did not diverge)
}

TEST_CASE("sim device: out-of-memory recovery on the device gives the run with the finer split") {
  auto sim = backend("reference-sim");
  // A budget the first micro-batch of 12 cannot fit with the model's state: the step reruns with
  // more, smaller micro-batches, which later steps keep. The same split chosen from the start on the
  // host gives the same numbers.
  const RunResult unconstrained = train_run(*sim);
  const RunResult tight = train_run(*sim, size_t{96} << 10);
  REQUIRE(tight.epochs[0].oom_retries > 0);
  const int64_t finer = tight.epochs[0].accumulate;
  CHECK(finer > 2);
  auto host = backend("reference");
  const RunResult same_split = train_run(*host, Allocator::kUnlimited, finer);
  check_same(tight, same_split);
  CHECK(unconstrained.state.size() == tight.state.size());
}

TEST_CASE("sim device: an evaluation out of memory halves its batch and gives the unconstrained figures") {
  // Evaluation is per sample: with a budget a batch of 32 exceeds but one of 8 fits, evaluate()
  // halves the batch (twice) and its probabilities, loss and accuracy are the unconstrained run's,
  // bit for bit. The batches are prefetched and copied by the batch uploader, whose slots are
  // trimmed at each halving (the failed batch's released first).
  auto sim = backend("reference-sim");
  auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 8, 5, 0.25);
  REQUIRE(model.ok());
  REQUIRE(move_to_device(*sim, **model).ok());
  std::vector<size_t> positions;
  for (size_t i = 0; i < 96 && i < lung().tiles().size(); ++i) positions.push_back(i);
  slide::core::ThreadPool pool(2);
  Allocator& alloc = sim->allocator();
  std::vector<float> want;
  auto free_run = evaluate(*sim, **model, lung(), positions, 32, &pool, &want);
  REQUIRE_MESSAGE(free_run.ok(), free_run.status().to_string());
  // What a batch of 8 needs at its peak, above what is live (the model): its compute and two input
  // slots (the batch computed, the next one uploaded). Measured on one batch of 8 alone, which
  // prefetches nothing (one slot), plus the second slot: a run over all the batches peaks with one
  // slot or two as the threads ran (the next batch's upload finds this batch's slot free when
  // decoding it outlasts this batch's compute, on a loaded host).
  const size_t live = alloc.current_bytes();
  const size_t slot8 = 8 * (3 * 16 * 16 * sizeof(float) + sizeof(int32_t));
  alloc.reset_peak();
  const std::vector<size_t> first8(positions.begin(), positions.begin() + 8);
  REQUIRE(evaluate(*sim, **model, lung(), first8, 8, &pool).ok());
  const size_t need8 = alloc.peak_bytes() - live + slot8;
  std::vector<float> small;
  alloc.reset_peak();
  auto eight = evaluate(*sim, **model, lung(), positions, 8, &pool, &small);
  REQUIRE_MESSAGE(eight.ok(), eight.status().to_string());
  CHECK(alloc.peak_bytes() - live <= need8);
  CHECK(small == want);
  // ... and what a batch of 16 needs (with one slot or two): more, or the halving would stop there.
  alloc.reset_peak();
  REQUIRE(evaluate(*sim, **model, lung(), positions, 16, &pool).ok());
  const size_t need16 = alloc.peak_bytes() - live;
  // Less spare than the 8 x 16 px images a slot kept at 16 would hold beyond one of 8.
  const size_t budget = need8 + slot8 / 2;
  REQUIRE(need16 > budget);
  alloc.set_budget_bytes(live + budget);
  std::vector<float> got;
  auto tight = evaluate(*sim, **model, lung(), positions, 32, &pool, &got);
  alloc.set_budget_bytes(Allocator::kUnlimited);
  REQUIRE_MESSAGE(tight.ok(), tight.status().to_string());
  CHECK(tight->oom_retries == 2);  // 32 -> 16 -> 8, which fits: no slot kept at an old size
  CHECK(got == want);
  CHECK(tight->loss == free_run->loss);
  CHECK(tight->accuracy == free_run->accuracy);
  CHECK(tight->samples == free_run->samples);
}

TEST_CASE("sim device: checkpoints download on save and upload on load; a device tensor needs its backend") {
  auto sim = backend("reference-sim");
  auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 4, 9);
  REQUIRE(model.ok());
  testing::randomise_bn(**model, 3);
  auto host_model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 4, 9);
  REQUIRE(host_model.ok());
  testing::randomise_bn(**host_model, 3);
  REQUIRE(move_to_device(*sim, **model).ok());
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*model)->collect("", &params, &buffers);
  std::vector<NamedTensor> named;
  for (auto* p : params) named.push_back({p->name, &p->value});
  for (auto* b : buffers) named.push_back({b->name, &b->value});
  const testing::ScratchDir dir("sim_ckpt");
  const std::string file = dir / "model.safetensors";
  const Status no_backend = save_safetensors(file, named);
  CHECK(no_backend.code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(no_backend.to_string().find("on sim") != std::string::npos);
  CHECK(!std::filesystem::exists(file));
  REQUIRE(save_safetensors(file, named, {{"format", "pt"}}, sim.get()).ok());
  // The file holds the host model's numbers (the same seed): saved from the device unchanged.
  auto ref = backend("reference");
  CHECK(state_of(*ref, **host_model) == state_of(*sim, **model));
  std::vector<Parameter*> hp;
  std::vector<Buffer*> hb;
  (*host_model)->collect("", &hp, &hb);
  for (auto* p : hp) REQUIRE(p->value.set_zero().ok());
  std::vector<NamedTensor> host_named;
  for (auto* p : hp) host_named.push_back({p->name, &p->value});
  for (auto* b : hb) host_named.push_back({b->name, &b->value});
  REQUIRE(load_safetensors(file, host_named).ok());
  CHECK(state_of(*ref, **host_model) == state_of(*sim, **model));
  // Loading into device tensors: through the backend, refused without it.
  for (auto* p : params) REQUIRE(p->value.set_zero().ok());
  CHECK(load_safetensors(file, named).code() == slide::core::StatusCode::kInvalidArgument);
  REQUIRE(load_safetensors(file, named, sim.get()).ok());
  CHECK(state_of(*ref, **host_model) == state_of(*sim, **model));
}


TEST_CASE("sim device: gather_augment on a dataset cached on the device makes load_batch's pixels bit for bit") {
  auto sim = backend("reference-sim");
  auto data = testing::tile_lc25000(16, "sim_device_gather");
  REQUIRE(!data->device_cached());
  // Uploaded in chunks of 100 tiles (100, 100, 100, 60 of the 360): host memory holds one chunk,
  // never the dataset.
  const size_t row = 16 * 16 * 3, chunk = 100 * row + 5;
  REQUIRE(data->decoded_bytes() == 360 * row);
  const size_t host_before = cpu_allocator().current_bytes();
  cpu_allocator().reset_peak();
  const Status cached = data->cache_on_device(*sim, nullptr, chunk);
  REQUIRE_MESSAGE(cached.ok(), cached.to_string());
  CHECK(cpu_allocator().peak_bytes() - host_before <= 100 * row + 4096);
  CHECK(cpu_allocator().current_bytes() == host_before);
  CHECK(data->device_cached());
  CHECK(!data->cached());  // no RAM cache was made for the upload
  Augmentation aug;
  aug.flips_rotations = true;
  aug.brightness = 0.3f, aug.contrast = 0.3f, aug.saturation = 0.3f, aug.hue = 0.1f;
  aug.crop_min_scale = 0.4f;
  aug.stain_sigma = 0.05f;
  const std::vector<size_t> positions = {0, 7, 7, 100, 359, 42, 3, 99, 299, 300};  // chunk edges too
  for (const Augmentation& a : {aug, Augmentation{}}) {
    for (uint64_t seed : {1u, 99u}) {
      Tensor host_images, host_labels, dev_images, dev_labels;
      REQUIRE(data->load_batch(positions, a, seed, nullptr, cpu_allocator(), &host_images, &host_labels).ok());
      const Status s = data->load_batch_on_device(*sim, positions, a, seed, &dev_images, &dev_labels);
      REQUIRE_MESSAGE(s.ok(), s.to_string());
      CHECK(dev_images.device() == Device::kSim);
      CHECK(dev_labels.device() == Device::kCpu);
      auto back = to_host(*sim, dev_images);
      REQUIRE(back.ok());
      REQUIRE(back->numel() == host_images.numel());
      CHECK(std::equal(host_images.data<float>(), host_images.data<float>() + host_images.numel(),
                       back->data<float>()));
      CHECK(std::equal(host_labels.data<int32_t>(), host_labels.data<int32_t>() + host_labels.numel(),
                       dev_labels.data<int32_t>()));
    }
  }
  // A host backend has no device cache; the op refuses a record outside the dataset.
  auto host = backend("reference");
  CHECK(data->cache_on_device(*host, nullptr).code() == slide::core::StatusCode::kInvalidArgument);
  auto tiles = Tensor::zeros({2, 4, 4, 3}, DType::kU8, sim->allocator());
  auto rec_host = Tensor::zeros({1, static_cast<int64_t>(sizeof(AugmentRecord))}, DType::kU8, cpu_allocator());
  REQUIRE(tiles.ok());
  REQUIRE(rec_host.ok());
  AugmentRecord bad;
  bad.index = 2;
  std::memcpy(rec_host->data<uint8_t>(), &bad, sizeof bad);
  auto rec = to_device(*sim, *rec_host);
  auto images = Tensor::empty({1, 3, 4, 4}, DType::kF32, sim->allocator());
  REQUIRE(rec.ok());
  REQUIRE(images.ok());
  const Status refused = sim->gather_augment(*tiles, *rec, *images);
  CHECK(refused.code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(refused.message().find("tile index 2 outside [0, 2)") != std::string::npos);
  bad.index = 1, bad.crop = 1, bad.crop_x = 2, bad.crop_w = 3, bad.crop_h = 1;
  std::memcpy(rec_host->data<uint8_t>(), &bad, sizeof bad);
  rec = to_device(*sim, *rec_host);
  REQUIRE(rec.ok());
  CHECK(sim->gather_augment(*tiles, *rec, *images).code() == slide::core::StatusCode::kInvalidArgument);
}

TEST_CASE("sim device: training with the dataset cached on the device (--cache device) equals the host run") {
  auto host = backend("reference");
  auto sim = backend("reference-sim");
  auto data = testing::tile_lc25000(16, "sim_device_cache");
  const RunResult a = train_run(*host, Allocator::kUnlimited, 2, *data, true);
  REQUIRE(data->cache_on_device(*sim, nullptr).ok());
  const RunResult b = train_run(*sim, Allocator::kUnlimited, 2, *data, true);
  check_same(a, b);
}

TEST_CASE("batch uploader: input batches copied on a copy thread, double buffered, slots reused and trimmed") {
  auto be = backend("reference-sim");
  // A copy thread that sleeps 30 ms before each copy: a ready() that did not wait for the copy
  // would let the download below read the slot before the batch is in it.
  BatchUploader up(*be, make_thread_copy_engine(std::chrono::milliseconds(30)));
  auto host = [](float v, int64_t n) {
    Tensor t = Tensor::empty({n, 3, 4, 4}, DType::kF32, cpu_allocator()).value();
    std::fill_n(t.data<float>(), t.numel(), v);
    return t;
  };
  auto labels = [](int32_t v, int64_t n) {
    Tensor t = Tensor::empty({n}, DType::kI32, cpu_allocator()).value();
    std::fill_n(t.data<int32_t>(), n, v);
    return t;
  };
  auto all_equal = [&](const Tensor& device, float v) {
    auto h = to_host(*be, device);
    REQUIRE_MESSAGE(h.ok(), h.status().to_string());
    return std::all_of(h->data<float>(), h->data<float>() + h->numel(), [&](float x) { return x == v; });
  };
  auto upload = [&](float v, int64_t n) {
    auto r = up.upload(host(v, n), labels(static_cast<int32_t>(v), n));
    REQUIRE_MESSAGE(r.ok(), r.status().to_string());
    return std::move(*r);
  };
  BatchUploader::Uploaded a = upload(1, 2);
  REQUIRE(up.ready(a).ok());
  CHECK(a.images.device() == Device::kSim);
  CHECK(a.images.shape() == Shape{2, 3, 4, 4});
  CHECK(all_equal(a.images, 1));
  // a is held: the next batch takes another slot and leaves a's alone.
  BatchUploader::Uploaded b = upload(2, 2);
  CHECK(b.slot != a.slot);
  REQUIRE(up.ready(b).ok());
  CHECK(all_equal(a.images, 1));
  CHECK(all_equal(b.images, 2));
  auto l = to_host(*be, b.labels).value();
  CHECK(l.data<int32_t>()[1] == 2);
  // a released: its slot takes the next batch (smaller: a view of the same buffer).
  const int slot_a = a.slot;
  Tensor a_buffer = a.images;
  a = {};
  BatchUploader::Uploaded c = upload(3, 1);
  CHECK(c.slot == slot_a);
  CHECK(c.images.shares_storage(a_buffer));
  CHECK(c.images.shape() == Shape{1, 3, 4, 4});
  REQUIRE(up.ready(c).ok());
  CHECK(all_equal(c.images, 3));
  CHECK(all_equal(b.images, 2));
  // A larger batch grows its slot's buffer.
  const int slot_b = b.slot;
  b = {};
  BatchUploader::Uploaded d = upload(4, 5);
  CHECK(d.slot == slot_b);
  REQUIRE(up.ready(d).ok());
  CHECK(all_equal(d.images, 4));
  CHECK(up.slot_count() == 2);
  // trim frees the buffers of the slots no batch holds (c's, once c is gone), not d's.
  c = {};
  a_buffer = Tensor();
  const size_t before = be->allocator().current_bytes();
  REQUIRE(up.trim().ok());
  CHECK(before - be->allocator().current_bytes() >= 2 * 3 * 4 * 4 * sizeof(float) + 2 * sizeof(int32_t));
  CHECK(all_equal(d.images, 4));
  CHECK(up.slot_count() == 2);  // the slot stays, without buffers: the next batch allocates them
  BatchUploader::Uploaded e = upload(5, 2);
  REQUIRE(up.ready(e).ok());
  CHECK(all_equal(e.images, 5));
  // A prefetched batch never used: the uploader's destructor waits for its copy.
}

TEST_SUITE_END();

}  // namespace libtrain_test_sim_device
