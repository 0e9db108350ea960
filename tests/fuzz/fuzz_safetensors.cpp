// slide::train::load_safetensors (model weights and checkpoints, often from other tools) on
// arbitrary file contents, into a fixed list of small tensors: "w" f32 [2, 3], "b" f32 [3],
// "step" i32 [1], "m" f64 [2] (corpus/fuzz_safetensors/ holds files with these names, written by
// tests/e2e/safetensors_io.py). Properties: never crashes or throws; errors are kNotFound never,
// kDataLoss or kInvalidArgument; on success every f32 / f64 value is finite.
#include <cmath>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "slide/train/checkpoint.h"

namespace {

using slide::train::DType;
using slide::train::Tensor;

struct Tensors {
  Tensor w, b, step, m;
  Tensors() {
    w = Tensor::zeros({2, 3}, DType::kF32, slide::train::cpu_allocator()).value();
    b = Tensor::zeros({3}, DType::kF32, slide::train::cpu_allocator()).value();
    step = Tensor::zeros({1}, DType::kI32, slide::train::cpu_allocator()).value();
    m = Tensor::zeros({2}, DType::kF64, slide::train::cpu_allocator()).value();
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Tensors* t = new Tensors();
  const std::string path = slide::fuzz::scratch_dir() + "/model.safetensors";
  slide::fuzz::write_bytes(path, data, size);
  auto st = slide::train::load_safetensors(path, {{"w", &t->w}, {"b", &t->b}, {"step", &t->step}, {"m", &t->m}});
  if (!st.ok()) {
    SLIDE_FUZZ_CHECK(st.code() == slide::core::StatusCode::kDataLoss ||
                     st.code() == slide::core::StatusCode::kInvalidArgument);
    return 0;
  }
  for (int i = 0; i < 6; ++i) SLIDE_FUZZ_CHECK(std::isfinite(t->w.data<float>()[i]));
  for (int i = 0; i < 3; ++i) SLIDE_FUZZ_CHECK(std::isfinite(t->b.data<float>()[i]));
  for (int i = 0; i < 2; ++i) SLIDE_FUZZ_CHECK(std::isfinite(t->m.data<double>()[i]));
  return 0;
}
