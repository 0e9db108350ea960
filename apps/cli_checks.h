// Number checks for CLI11 options whose failures a user can read. CLI11 2.1's CLI::PositiveNumber
// and CLI::NonNegativeNumber are Ranges over doubles whose message prints both bounds
// ("--epochs: Value 0 not in range 0.000000 to 179769313486231570814527423731704356798..."): the
// lower bound of PositiveNumber is the smallest positive double, which prints as 0.
#pragma once

#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdlib>
#include <string>

namespace slide::apps {

// `value` as a finite number (strtod's syntax, the whole text), into *v; false for anything else
// (empty, trailing text, inf, nan). The numeric options' checks (here and train_common.h's
// check_number_option) read their values through it.
inline bool finite_number(const std::string& value, double* v) {
  char* end = nullptr;
  *v = std::strtod(value.c_str(), &end);
  return !value.empty() && end != value.c_str() && *end == '\0' && std::isfinite(*v);
}

// A validator that passes a finite number above 0 (or at 0 too, with `allow_zero`); else the
// message "must be <says>, not <value>" (CLI11 puts the option's name before it). `name` is what
// --help shows after the option's type, CLI11's names kept (POSITIVE, NONNEGATIVE).
inline CLI::Validator number_at_least_zero(bool allow_zero, const std::string& says, const std::string& name) {
  return CLI::Validator(
      [allow_zero, says](std::string& value) -> std::string {
        double v = 0;
        if (finite_number(value, &v) && (allow_zero ? v >= 0 : v > 0)) return "";
        return "must be " + says + ", not " + value;
      },
      name, name);
}

// What CLI::PositiveNumber checks (> 0), with a plain message.
inline CLI::Validator positive_number() { return number_at_least_zero(false, "a number above 0", "POSITIVE"); }

// What CLI::NonNegativeNumber checks (>= 0), with a plain message.
inline CLI::Validator non_negative_number() { return number_at_least_zero(true, "a number >= 0", "NONNEGATIVE"); }

}  // namespace slide::apps
