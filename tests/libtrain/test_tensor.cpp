// Tensors and the budgeted allocator: an exceeded budget is kResourceExhausted, never a crash,
// and the counters return to zero when tensors go away.
#include <doctest/doctest.h>

#include "slide/train/allocator.h"
#include "slide/train/tensor.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtrain_test_tensor {

using slide::core::StatusCode;
using namespace slide::train;

TEST_CASE("allocator: budget, current and peak bytes") {
  CpuAllocator a;
  a.set_budget_bytes(1000);
  {
    auto t = Tensor::zeros({10, 20}, DType::kF32, a, "activations");  // 800 bytes
    REQUIRE_MESSAGE(t.ok(), t.status().to_string());
    CHECK(a.current_bytes() == 800);
    CHECK(t->numel() == 200);
    CHECK(t->data<float>()[199] == 0.0f);
    auto over = Tensor::empty({100}, DType::kF32, a, "weights");  // 400 more: 1200 > 1000
    REQUIRE_FALSE(over.ok());
    CHECK(over.status().code() == StatusCode::kResourceExhausted);
    CHECK(over.status().message().find("budget of 1000 bytes") != std::string::npos);
    CHECK(over.status().message().find("weights [100] f32") != std::string::npos);
    CHECK(a.current_bytes() == 800);  // the failed allocation took nothing
    auto fits = Tensor::empty({50}, DType::kF32, a);
    REQUIRE(fits.ok());
    CHECK(a.peak_bytes() == 1000);
  }
  CHECK(a.current_bytes() == 0);
  CHECK(a.peak_bytes() == 1000);
  a.reset_peak();
  CHECK(a.peak_bytes() == 0);
}

TEST_CASE("tensor: shapes, copies share storage, clone copies, reshape checks counts") {
  CpuAllocator a;
  auto t = Tensor::empty({2, 3, 4, 5}, DType::kF64, a);
  REQUIRE(t.ok());
  CHECK(t->bytes() == 2 * 3 * 4 * 5 * 8);
  CHECK(shape_string(t->shape()) == "[2, 3, 4, 5]");
  Tensor alias = *t;
  alias.data<double>()[7] = 3.5;
  CHECK(t->data<double>()[7] == 3.5);
  auto c = t->clone();
  REQUIRE(c.ok());
  c->data<double>()[7] = 1.0;
  CHECK(t->data<double>()[7] == 3.5);
  CHECK(a.current_bytes() == 2 * t->bytes());
  auto r = t->reshape({6, 20});
  REQUIRE(r.ok());
  CHECK(r->data<double>() == t->data<double>());
  CHECK(t->reshape({7, 20}).status().code() == StatusCode::kInvalidArgument);
  CHECK(Tensor::empty({2, -1}, DType::kF32, a).status().code() == StatusCode::kInvalidArgument);
  CHECK_FALSE(Tensor().defined());
}

TEST_CASE("parse_bytes: binary units") {
  CHECK(*parse_bytes("4096") == 4096u);
  CHECK(*parse_bytes("512M") == 512u << 20);
  CHECK(*parse_bytes("2G") == size_t{2} << 30);
  CHECK(*parse_bytes("1.5GiB") == size_t{3} << 29);
  CHECK(*parse_bytes("64kb") == 64u << 10);
  CHECK(parse_bytes("lots").status().code() == StatusCode::kInvalidArgument);
  CHECK(parse_bytes("3X").status().code() == StatusCode::kInvalidArgument);
  CHECK(parse_bytes("-1G").status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("tensor: view is a window of another tensor's storage; out-of-range views refused") {
  auto flat = Tensor::zeros({10}, DType::kF32, cpu_allocator(), "flat");
  REQUIRE(flat.ok());
  auto v = flat->view(4, {2, 3});
  REQUIRE(v.ok());
  CHECK(v->numel() == 6);
  CHECK(v->shape() == Shape{2, 3});
  CHECK(v->data<float>() == flat->data<float>() + 4);
  CHECK(v->shares_storage(*flat));
  v->data<float>()[5] = 7.0f;  // element 9 of flat
  CHECK(flat->data<float>()[9] == 7.0f);
  auto vv = v->view(1, {2});  // a view of a view: elements 5, 6 of flat
  REQUIRE(vv.ok());
  CHECK(vv->data<float>() == flat->data<float>() + 5);
  auto c = v->clone();  // clone copies the window only
  REQUIRE(c.ok());
  CHECK(c->numel() == 6);
  CHECK(c->data<float>()[5] == 7.0f);
  CHECK_FALSE(c->shares_storage(*flat));
  CHECK(flat->view(5, {6}).status().code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(flat->view(-1, {2}).status().code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(flat->view(0, {1LL << 40, 1LL << 40}).status().code() == slide::core::StatusCode::kInvalidArgument);
  CHECK(flat->view(10, {0}).ok());  // an empty view at the end
  Tensor keep = *flat->view(2, {3});
  flat = Tensor::zeros({1}, DType::kF32, cpu_allocator(), "other");  // the storage lives on in `keep`
  CHECK(keep.data<float>()[0] == 0.0f);
}

}  // namespace libtrain_test_tensor
