// Stain normalisation at load time (slide-embed, slide-train --stain-normalize): libtile's
// (slide/tile/stain.h: Reinhard, Macenko and Vahadane, formulas and sources there), named in slide::train
// for the loaders. The same functions normalise tiles at tiling time (slide-tile).
#pragma once

#include "slide/tile/stain.h"

namespace slide::train {

using slide::tile::fit_stain_target;
using slide::tile::lab_to_rgb;
using slide::tile::normalise_stain;
using slide::tile::parse_stain_method;
using slide::tile::rgb_to_lab;
using slide::tile::StainMethod;
using slide::tile::stain_method_name;
using slide::tile::StainTarget;
using slide::tile::stain_target_for_options;
using slide::tile::stain_target_from_json;
using slide::tile::stain_target_to_json;

}  // namespace slide::train
