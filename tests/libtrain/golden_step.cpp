// For the numerics test against torchvision (tests/e2e/test_slide_train.py, TestTorchvision):
// loads a ResNet's parameters and buffers (torchvision names) and an input batch from safetensors,
// runs one training step on the cpu backend (forward in training mode, mean cross-entropy,
// backward, SGD lr 0.01 momentum 0.9 no weight decay), and writes the logits, the loss and every
// parameter and buffer after the step.
//
// usage: golden_step MODEL.safetensors INPUT.safetensors OUT.safetensors DEPTH CLASSES
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "slide/train/checkpoint.h"
#include "slide/train/optimizer.h"

using namespace slide::train;

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: golden_step MODEL.safetensors INPUT.safetensors OUT.safetensors DEPTH CLASSES\n");
    return 2;
  }
  const int depth = std::atoi(argv[4]);
  const int64_t classes = std::atoll(argv[5]);
  auto die = [](const slide::core::Status& s) {
    std::fprintf(stderr, "%s\n", s.to_string().c_str());
    return 1;
  };
  auto be = make_backend("cpu");
  auto net = make_resnet(cpu_allocator(), DType::kF32, depth, classes, 0);
  if (!be.ok()) return die(be.status());
  if (!net.ok()) return die(net.status());
  std::vector<Parameter*> params;
  std::vector<Buffer*> buffers;
  (*net)->collect("", &params, &buffers);
  std::vector<NamedTensor> state;
  for (auto* p : params) state.push_back({p->name, &p->value});
  for (auto* b : buffers) state.push_back({b->name, &b->value});
  if (auto s = load_safetensors(argv[1], state); !s.ok()) return die(s);
  // The input's shape is read from the file by trying the test's fixed batch layout.
  Tensor x = *Tensor::empty({4, 3, 64, 64}, DType::kF32, cpu_allocator());
  Tensor y = *Tensor::empty({4}, DType::kI32, cpu_allocator());
  if (auto s = load_safetensors(argv[2], {{"x", &x}, {"y", &y}}); !s.ok()) return die(s);

  OptimizerConfig oc;
  oc.momentum = 0.9;
  oc.weight_decay = 0;
  auto opt = Optimizer::make(oc, params, cpu_allocator());
  if (!opt.ok()) return die(opt.status());
  auto logits = (*net)->forward(**be, x, true);
  if (!logits.ok()) return die(logits.status());
  Tensor logits_copy = *logits->clone();
  Tensor probs = *Tensor::empty(logits->shape(), DType::kF32, cpu_allocator());
  Tensor dlogits = *Tensor::empty(logits->shape(), DType::kF32, cpu_allocator());
  double loss = 0;
  if (auto s = (*be)->softmax_cross_entropy_forward(*logits, y, Tensor(), 0, probs, &loss); !s.ok()) return die(s);
  if (auto s = (*be)->softmax_cross_entropy_backward(probs, y, Tensor(), 0, dlogits); !s.ok()) return die(s);
  if (auto s = (*net)->backward(**be, dlogits).status(); !s.ok()) return die(s);
  if (auto s = (*opt)->step(**be, 0.01); !s.ok()) return die(s);
  Tensor loss_t = *Tensor::empty({1}, DType::kF32, cpu_allocator());
  loss_t.data<float>()[0] = static_cast<float>(loss);
  std::vector<NamedTensor> out{{"logits", &logits_copy}, {"loss", &loss_t}};
  out.insert(out.end(), state.begin(), state.end());
  if (auto s = save_safetensors(argv[3], out); !s.ok()) return die(s);
  return 0;
}
