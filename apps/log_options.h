// -q, -v and --log-json, as every tool takes them (one vocabulary of log levels: libcore log.h).
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "slide/core/log.h"

namespace slide::apps {

struct LogOptions {
  bool quiet = false, verbose = false, json = false;
};

// Adds -q/--quiet (warnings and errors only), -v/--verbose (also debug records; `verbose_help`
// says which) and --log-json (records as JSON lines on stderr) to `app`.
inline void add_log_options(CLI::App& app, LogOptions* o, const std::string& verbose_help) {
  app.add_flag("-q,--quiet", o->quiet, "Only warnings and errors; no progress");
  app.add_flag("-v,--verbose", o->verbose, "Also debug records (" + verbose_help + ")");
  app.add_flag("--log-json", o->json, "Log records as JSON lines on stderr");
}

// Sets the process's log format and level from the parsed options (-v wins over -q).
inline void apply_log_options(const LogOptions& o) {
  slide::core::set_log_json(o.json);
  if (o.quiet) slide::core::set_log_level(slide::core::LogLevel::kWarn);
  if (o.verbose) slide::core::set_log_level(slide::core::LogLevel::kDebug);
}

}  // namespace slide::apps
