// --stain-normalize and --stain-reference, as slide-tile (at tiling time), slide-train and
// slide-embed (at load time) take them (the target is fitted by stain_target_for_options,
// slide/tile/stain.h).
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace slide::apps {

struct StainOptions {
  std::string method = "none", reference;
};

// Adds both options to `app`; `where` says where the tool applies and records the target (appended
// to --stain-normalize's help).
inline void add_stain_options(CLI::App& app, StainOptions* o, const std::string& where, const std::string& recorded_in) {
  app.add_option("--stain-normalize", o->method,
                 "Stain normalisation of every tile after decoding, " + where +
                     ": none, reinhard (Lab mean/std matching, Reinhard 2001) or macenko (H&E stain vectors, Macenko "
                     "2009), fitted once on --stain-reference")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "reinhard", "macenko"}));
  app.add_option("--stain-reference", o->reference,
                 "The reference tile for --stain-normalize: a JPEG/PNG/TIFF image, or a .json target recorded before (" +
                     recorded_in + ")");
}

}  // namespace slide::apps
