// --backend, --device and --precision, as slide-train, slide-train evaluate and slide-embed take them, and the
// backend they name opened with one rule: one that cannot start (an unknown name, a build without
// CUDA, no driver, no device) is a usage error naming the reason (kInvalidArgument: exit 2).
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>

#include "cli_checks.h"
#include "slide/core/log.h"
#include "slide/train/allocator.h"
#include "slide/train/backend.h"

namespace slide::apps {

inline constexpr const char* kBackendHelp =
    "cpu (oneDNN) | cuda (one GPU; built with CUDA) | auto (cuda when a GPU answers, else cpu) | reference | "
    "reference-sim (the reference backend on a simulated device: the device paths without a GPU)";

// Adds --backend (into *backend, its default kept) and --device (into *device, -1 when unset) to `app`.
inline void add_backend_options(CLI::App& app, std::string* backend, int* device, const std::string& extra_help = "") {
  app.add_option("--backend", *backend, std::string(kBackendHelp) + extra_help)->capture_default_str();
  app.add_option("--device", *device,
                 "The GPU for --backend cuda (default: the launcher's node-local rank, from mpirun's or srun's "
                 "environment, else 0)")
      ->check(non_negative_number());
}

// Adds --precision (into *precision, its default "fp32" kept): the math precision of the
// convolutions and matrix products (backend.h MathPrecision); storage stays f32.
inline void add_precision_option(CLI::App& app, std::string* precision) {
  app.add_option("--precision", *precision,
                 "Math precision of the convolutions and matrix products: fp32 | tf32 (NVIDIA tensor cores; f32 on "
                 "CPUs) | bf16 (tensor cores on GPUs, AVX512-BF16/AMX on CPUs, else f32) | fp16 (tensor cores; f32 "
                 "on CPUs; training with dynamic loss scaling). Weights, activations, gradients and optimizer "
                 "state stay f32")
      ->capture_default_str();
}

// The backend `name` on `device`, its math precision set to `precision` ("fp32", "tf32", "bf16"
// or "fp16"). Errors: kInvalidArgument (exit 2) for a backend that cannot start or a precision that
// is not one of those, naming the option.
inline slide::core::Result<std::unique_ptr<slide::train::Backend>> open_backend(const std::string& name, int device,
                                                                               const std::string& precision = "fp32") {
  auto p = slide::train::parse_math_precision(precision);
  if (!p.ok()) return slide::core::invalid_argument("--precision " + precision + ": " + p.status().message());
  auto be = slide::train::make_backend(name, device);
  if (!be.ok()) return slide::core::invalid_argument("--backend " + name + ": " + be.status().message());
  if (auto s = (*be)->set_math_precision(*p); !s.ok())
    return slide::core::invalid_argument("--precision " + precision + " on --backend " + name + ": " + s.message());
  // What the precision means on this CPU (backend.h MathPrecision): a user who asked for bf16 on a
  // CPU without bf16 instructions should know that it runs as fp32.
  if ((*be)->name() == "cpu" && *p != slide::train::MathPrecision::kFp32) {
    if (*p == slide::train::MathPrecision::kBf16 && slide::train::cpu_has_bf16_instructions())
      slide::core::log_info("math precision", {{"precision", precision}, {"cpu", "bf16 instructions (oneDNN)"}});
    else
      slide::core::log_info("math precision: the products run in fp32 on this CPU",
                            {{"precision", precision},
                             {"why", *p == slide::train::MathPrecision::kBf16 ? "no AVX512_BF16 or AMX"
                                                                               : "no such mode in oneDNN 2.6"}});
  }
  // Where the backend keeps inference activations in half precision (cuda under fp16 / bf16: the
  // ViT's trunk and the CNNs' inference graph), say so.
  if (const slide::train::DType act = (*be)->activation_dtype(); act != slide::train::DType::kF32)
    slide::core::log_info("half-precision activations for inference (ViT trunk, CNN inference graph)",
                          {{"precision", precision}, {"activations", slide::train::dtype_name(act)}});
  return be;
}

// --memory-budget's value as the bytes of a budget for the backend's allocator (parse_bytes's
// forms: "8G", "512M", "1.5G", a plain count of bytes); empty (the option not given):
// Allocator::kUnlimited. Errors: kInvalidArgument naming --memory-budget and what is wrong.
inline slide::core::Result<size_t> parse_memory_budget(const std::string& value) {
  if (value.empty()) return slide::train::Allocator::kUnlimited;
  auto b = slide::train::parse_bytes(value);
  if (!b.ok()) return b.status().with_context("--memory-budget");
  return *b;
}

// slide-train's --channels-last rule (bench/train_step follows it): "on" always, "auto" where the
// activations are half precision on cuda, "off" never.
inline bool channels_last_activations(const std::string& option, slide::train::DType activations,
                                      const slide::train::Backend& be) {
  return option == "on" || (option == "auto" && activations != slide::train::DType::kF32 && be.name() == "cuda");
}

}  // namespace slide::apps
