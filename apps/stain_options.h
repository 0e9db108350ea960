// --stain-normalize and --stain-reference, as slide-tile (at tiling time), slide-train and
// slide-embed (at load time) take them (the target is fitted by stain_target_for_options,
// slide/tile/stain.h).
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "slide/core/log.h"
#include "slide/core/status.h"
#include "slide/tile/stain.h"

namespace slide::apps {

struct StainOptions {
  std::string method = "none", reference;
};

// Adds both options to `app`; `where` says where the tool applies and records the target (appended
// to --stain-normalize's help).
inline void add_stain_options(CLI::App& app, StainOptions* o, const std::string& where, const std::string& recorded_in) {
  app.add_option("--stain-normalize", o->method,
                 "Stain normalisation of every tile after decoding, " + where +
                     ": none, reinhard (Lab mean/std matching, Reinhard 2001), macenko (H&E stain vectors, Macenko "
                     "2009) or vahadane (sparse non-negative stain separation, Vahadane 2016), fitted once on "
                     "--stain-reference")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "reinhard", "macenko", "vahadane"}));
  app.add_option("--stain-reference", o->reference,
                 "The reference tile for --stain-normalize: a JPEG/PNG/TIFF image, or a .json target recorded before (" +
                     recorded_in + ")");
}

// The options' target (stain_target_for_options: fitted on the reference, or kNone), with one log
// line `what` naming the reference and the target when there is one. Errors: its (usage errors).
inline slide::core::Result<slide::tile::StainTarget> stain_target_of(const StainOptions& o, const char* what) {
  auto target = slide::tile::stain_target_for_options(o.method, o.reference);
  if (target.ok() && target->method != slide::tile::StainMethod::kNone)
    slide::core::log_info(what, {{"reference", o.reference}, {"target", slide::tile::stain_target_to_json(*target)}});
  return target;
}

}  // namespace slide::apps
