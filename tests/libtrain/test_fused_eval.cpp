// slide-train evaluate's fused path: evaluate() with logits from the model's inference graph cut at
// "fc" (inference_graph.h: batch norm folded, ReLU and residual adds fused, blocked layouts; built,
// prepared and run as apps/slide_train_predict.cpp does) against evaluate() with
// the engine's forward, on real tiles (the LC25000 lung subset tiled at 32 px), for the small CNN
// and ResNet-18 with batch norm statistics and affine parameters away from 0/1, so that a wrong
// fold shows in the probabilities. The layer-by-layer comparison of the two paths is in
// tests/cache/test_embed.cpp; this one checks the metrics and probabilities evaluate() reports.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>

#include "slide/tile/pipeline.h"
#include "slide/train/embed.h"
#include "slide/train/trainer.h"
#include "test_fixtures.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_fused_eval {

using namespace slide::train;

namespace {

// The LC25000 subset (360 patches, 3 classes) as a 32 px store, made once per process.
const TileDataset& lc25000() {
  static std::unique_ptr<TileDataset> data = testing::tile_lc25000(32, "fused_eval");
  return *data;
}

using testing::randomise_bn;

// evaluate() through the engine and through the inference graph agree on every figure.
void check_same(Sequential& model, const std::vector<size_t>& positions, int64_t batch) {
  auto be = make_backend("cpu");
  REQUIRE(be.ok());
  slide::core::ThreadPool pool(2);
  std::vector<float> p_engine, p_fused;
  auto engine = evaluate(**be, model, lc25000(), positions, batch, &pool, &p_engine);
  REQUIRE_MESSAGE(engine.ok(), engine.status().to_string());
  auto cut = find_cut(model, "fc");
  REQUIRE_MESSAGE(cut.ok(), cut.status().to_string());
  auto graph = InferenceGraph::build(model, *cut);
  REQUIRE_MESSAGE(graph.ok(), graph.status().to_string());
  REQUIRE(graph->prepare(**be).ok());
  const LogitsFn fused_logits = [&](const Tensor& images) { return graph->run(**be, images); };
  auto fused = evaluate(**be, fused_logits, lc25000(), positions, batch, &pool, &p_fused);
  REQUIRE_MESSAGE(fused.ok(), fused.status().to_string());
  CHECK(fused->samples == static_cast<int64_t>(positions.size()));
  CHECK(fused->samples == engine->samples);
  CHECK(fused->steps == engine->steps);
  REQUIRE(p_fused.size() == p_engine.size());
  double max_diff = 0;
  for (size_t i = 0; i < p_fused.size(); ++i)
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(p_fused[i]) - p_engine[i]));
  CHECK_MESSAGE(max_diff < 1e-5, "max |p_fused - p_engine| = " << max_diff);
  CHECK(fused->loss == doctest::Approx(engine->loss).epsilon(1e-5));
  CHECK(fused->accuracy == engine->accuracy);
  CHECK(fused->balanced_accuracy == engine->balanced_accuracy);
  CHECK(fused->roc_auc == doctest::Approx(engine->roc_auc).epsilon(1e-5));
  CHECK(fused->recall == engine->recall);
  // Not a vacuous comparison: the model separates the tiles (its probabilities are not uniform).
  double spread = 0;
  for (size_t i = 0; i + 2 < p_fused.size(); i += 3)
    spread = std::max(spread, static_cast<double>(std::max({p_fused[i], p_fused[i + 1], p_fused[i + 2]})) - 1.0 / 3);
  CHECK(spread > 0.01);
}

}  // namespace

TEST_SUITE_BEGIN("fused_eval");

TEST_CASE("fused evaluate equals the engine's: small CNN on the 360 LC25000 tiles, batches of 64 and a tail of 40") {
  auto model = make_small_cnn(cpu_allocator(), DType::kF32, 3, 3, 8, 5);
  REQUIRE(model.ok());
  randomise_bn(**model, 9);
  std::vector<size_t> all(lc25000().tiles().size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  REQUIRE(all.size() == 360);
  check_same(**model, all, 64);
}

TEST_CASE("fused evaluate equals the engine's: ResNet-18 on 50 LC25000 tiles") {
  auto model = make_resnet(cpu_allocator(), DType::kF32, 18, 3, 6);
  REQUIRE(model.ok());
  randomise_bn(**model, 10);
  std::vector<size_t> some;
  for (size_t i = 0; i < 360; i += 7) some.push_back(i);  // every class
  check_same(**model, some, 16);
}

TEST_CASE("evaluate with a logits function: logits of the wrong shape are an error naming it") {
  auto be = make_backend("cpu");
  REQUIRE(be.ok());
  const LogitsFn two_classes = [&](const Tensor& images) {
    return Tensor::zeros({images.dim(0), 2}, DType::kF32, (*be)->allocator());
  };
  auto st = evaluate(**be, two_classes, lc25000(), {0, 1, 2}, 8, nullptr);
  REQUIRE_FALSE(st.ok());
  CHECK(st.status().code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(st.status().to_string().find("[3, 2]") != std::string::npos);
}

TEST_SUITE_END();

}  // namespace libtrain_test_fused_eval
