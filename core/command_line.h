#pragma once

// Command-line conventions shared by `moe-ep` and `moe-ep-worker` (issue 9
// item 5): the project version that `--version` prints, the exit status of a
// command line that does not parse, and range checks whose message a person
// can read ("expected a number > 0, got -3", not a 309-digit bound). No
// command-line library here: each binary wraps these in its own (CLI11)
// validators. Pure and thread-safe. Source: issue 9 item 5.

#include <string>
#include <string_view>

namespace moe_ep::core {

// Exit status of both binaries for a command line they cannot parse: an
// unknown flag, a missing or malformed value, a value out of range. `--help`
// and `--version` exit 0.
inline constexpr int kExitBadCommandLine = 2;

// Returns the project version, CMake's project(VERSION), e.g. "0.1.0".
std::string_view Version();

// Returns "" when `text` is a number >= `min` (> `min` when `strict`), else
// the reason, e.g. CheckAtLeast("-3", 0, true) == "expected a number > 0, got
// -3" and CheckAtLeast("x", 0, false) == "expected a number >= 0, got x".
// A bound that is a whole number prints without a fraction ("> 0").
std::string CheckAtLeast(std::string_view text, double min, bool strict);

// Returns the underscore spelling of a kebab-case flag name ("log-level" ->
// "log_level"); names without '-' come back unchanged. The worker accepts
// these spellings as aliases for one release.
std::string UnderscoreSpelling(std::string_view kebab_name);

}  // namespace moe_ep::core
