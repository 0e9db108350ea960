// A checkpoint's state.json (slide-train's record of a run, read by --resume, evaluate and predict;
// checkpoints are copied between machines and edited by hand) through
// slide::apps::open_checkpoint_record (read, parse, validate_run_state) and check_resume_config,
// on arbitrary file contents in a checkpoints/epoch-E-step-S directory. Properties:
//   - never crashes or throws; errors are kDataLoss naming the state file, in valid UTF-8 (the
//     message goes into JSON logs and a sweep's results.json, whose dump throws on bad UTF-8);
//   - the directory and its model.safetensors (a weights file next to the record) give the same
//     record and the same verdict;
//   - a record it accepts can be used as slide-train uses it after the check without throwing:
//     epoch, step_in_epoch, optimizer_steps >= 0 and epochs >= 1 as int64; classes as >= 2
//     strings; history one object per completed epoch with epoch >= 1 and numbers (val_roc_auc
//     may be null); "abmil": mil's sizes >= 1 and dropout a number, the encoder's fields
//     strings when it is there; tile models: width >= 1;
//     memory (when present): strategy micro-batch|checkpoint|offload, segments a string,
//     accumulate and ranks >= 1; loss_scaler (when present): scale a finite number > 0,
//     growth_tracker >= 0;
//   - labels (when present): sha256 a string, per_class's counts integers >= 0; check_resume_labels
//     passes with the record's own labels and refuses other ones (kInvalidArgument naming the
//     checkpoint, in valid UTF-8);
//   - check_resume_config with the record's own config (and epochs) passes; with no config at all
//     it fails (kInvalidArgument naming the checkpoint) exactly when the record's config names an
//     option other than init.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "fuzz_util.h"
#include "train_common.h"

namespace {

using slide::core::StatusCode;

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return false;
    i += n;
  }
  return true;
}

int64_t as_int(const nlohmann::json& j) {
  SLIDE_FUZZ_CHECK(j.is_number_integer());
  return j.get<int64_t>();
}

void check_usable(const nlohmann::json& s) {
  SLIDE_FUZZ_CHECK(s.is_object());
  SLIDE_FUZZ_CHECK(as_int(s["epoch"]) >= 0);
  SLIDE_FUZZ_CHECK(as_int(s["step_in_epoch"]) >= 0);
  SLIDE_FUZZ_CHECK(as_int(s["optimizer_steps"]) >= 0);
  SLIDE_FUZZ_CHECK(as_int(s["epochs"]) >= 1);
  SLIDE_FUZZ_CHECK(s["model"].is_string());
  SLIDE_FUZZ_CHECK(s["classes"].get<std::vector<std::string>>().size() >= 2);
  const nlohmann::json& h = s["history"];
  SLIDE_FUZZ_CHECK(h.is_array() && static_cast<int64_t>(h.size()) == as_int(s["epoch"]));
  for (const auto& e : h) {
    SLIDE_FUZZ_CHECK(e.is_object() && as_int(e["epoch"]) >= 1);
    for (const char* key : {"train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_balanced_accuracy", "lr",
                            "seconds"})
      (void)e[key].get<double>();
    SLIDE_FUZZ_CHECK(e["val_roc_auc"].is_null() || e["val_roc_auc"].is_number());
  }
  if (s.contains("best_epoch")) SLIDE_FUZZ_CHECK(as_int(s["best_epoch"]) >= 1);
  if (s.contains("best_score")) (void)s["best_score"].get<double>();
  if (s.contains("config")) SLIDE_FUZZ_CHECK(s["config"].is_object());
  if (s.contains("memory")) {  // read by --resume (slide_train_main.cpp)
    const nlohmann::json& m = s["memory"];
    const std::string strategy = m["strategy"].get<std::string>();
    SLIDE_FUZZ_CHECK(strategy == "micro-batch" || strategy == "checkpoint" || strategy == "offload" ||
                     strategy == "checkpoint+offload");
    (void)m["segments"].get<std::string>();
    SLIDE_FUZZ_CHECK(as_int(m["accumulate"]) >= 1 && as_int(m["ranks"]) >= 1);
  }
  if (s.contains("loss_scaler")) {  // read by --resume under --precision fp16
    const double scale = s["loss_scaler"]["scale"].get<double>();
    SLIDE_FUZZ_CHECK(scale > 0 && std::isfinite(scale) && as_int(s["loss_scaler"]["growth_tracker"]) >= 0);
  }
  if (s.contains("labels")) {  // read by --resume (check_resume_labels)
    (void)s["labels"]["sha256"].get<std::string>();
    for (const auto& [name, n] : s["labels"]["per_class"].items()) SLIDE_FUZZ_CHECK(as_int(n) >= 0);
  }
  if (s["model"] == "abmil") {
    for (const char* key : {"in_features", "hidden", "attention"}) SLIDE_FUZZ_CHECK(as_int(s["mil"][key]) >= 1);
    (void)s["mil"]["dropout"].get<double>();
    if (s.contains("encoder"))  // read by evaluate, predict and --resume (check_bag_encoder)
      for (const char* key : {"model", "layer", "weights_sha256"}) (void)s["encoder"][key].get<std::string>();
  } else if (s.contains("width")) {
    SLIDE_FUZZ_CHECK(as_int(s["width"]) >= 1);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    const std::string d = slide::fuzz::scratch_dir() + "/checkpoints/epoch-1-step-0";
    std::filesystem::create_directories(d);
    return d;
  }();
  const std::string file = dir + "/state.json";
  slide::fuzz::write_bytes(file, data, size);

  auto record = slide::apps::open_checkpoint_record(dir);
  auto by_weights = slide::apps::open_checkpoint_record(dir + "/model.safetensors");
  SLIDE_FUZZ_CHECK(record.ok() == by_weights.ok());
  if (!record.ok()) {
    const auto& st = record.status();
    SLIDE_FUZZ_CHECK(st.code() == StatusCode::kDataLoss);
    SLIDE_FUZZ_CHECK(st.message().rfind(file + ": ", 0) == 0);
    SLIDE_FUZZ_CHECK(valid_utf8(st.message()));
    SLIDE_FUZZ_CHECK(by_weights.status().code() == st.code() && by_weights.status().message() == st.message());
    return 0;
  }
  SLIDE_FUZZ_CHECK(record->state_file == file && by_weights->state_file == file);
  SLIDE_FUZZ_CHECK(record->weights == dir + "/model.safetensors" && by_weights->weights == record->weights);
  SLIDE_FUZZ_CHECK(record->state == by_weights->state);
  const nlohmann::json& s = record->state;
  check_usable(s);

  const long epochs = static_cast<long>(s["epochs"].get<int64_t>());
  const nlohmann::json own = s.contains("config") ? s["config"] : nlohmann::json::object();
  SLIDE_FUZZ_CHECK(slide::apps::check_resume_config(dir, s, own, epochs).ok());
  bool other_than_init = false;
  for (const auto& [key, value] : own.items()) other_than_init = other_than_init || key != "init";
  const auto none = slide::apps::check_resume_config(dir, s, nlohmann::json::object(), epochs);
  SLIDE_FUZZ_CHECK(none.ok() == !other_than_init);
  if (!none.ok()) {
    SLIDE_FUZZ_CHECK(none.code() == StatusCode::kInvalidArgument);
    SLIDE_FUZZ_CHECK(none.message().find(dir) != std::string::npos);
    SLIDE_FUZZ_CHECK(valid_utf8(none.message()));
  }
  // --resume's labels check: the record's own labels pass; other labels (or a record without them
  // against one with them) fail naming the checkpoint, in valid UTF-8.
  if (s.contains("labels")) {
    SLIDE_FUZZ_CHECK(slide::apps::check_resume_labels(dir, s, s["labels"]).ok());
    auto other = slide::apps::labels_record({{{"slide", "class"}, 1}});
    SLIDE_FUZZ_CHECK(other.ok());
    const auto refused = slide::apps::check_resume_labels(dir, s, *other);
    SLIDE_FUZZ_CHECK(refused.ok() == (s["labels"] == *other));
    if (!refused.ok()) {
      SLIDE_FUZZ_CHECK(refused.code() == StatusCode::kInvalidArgument);
      SLIDE_FUZZ_CHECK(refused.message().find(dir) != std::string::npos);
      SLIDE_FUZZ_CHECK(valid_utf8(refused.message()));
    }
  }
  return 0;
}
