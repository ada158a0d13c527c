#pragma once

// The command-line habits of `moe-ep` (issue 9 item 5, issue 31 item 7):
// CLI11 range checks whose message a person can read (CLI11's PositiveNumber
// / NonNegativeNumber print their upper bound, DBL_MAX, as a 309-digit
// number; these say "--tokens: expected a number > 0, got -3", wording from
// core/command_line.h, which the worker's flags share); the nearest
// subcommand to a mistyped one; which errors are a refused command line
// (exit status 2, core::kExitBadCommandLine); and the defaults every
// subcommand shares. Thread-safe (immutable validators, pure functions).

#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace moe_ep::client {

// --rpc-timeout of every subcommand that has one (run, stack), seconds: the
// deadline of each fanned-out call (loading a DeepSeek-V3 layer's experts
// from a checkpoint takes minutes on a slow disk).
inline constexpr double kDefaultRpcTimeoutSeconds = 600;

// A number > 0 ("expected a number > 0, got 0").
const CLI::Validator& Positive();

// A number >= 0 ("expected a number >= 0, got -1").
const CLI::Validator& NonNegative();

// NearestName()
//
// The entry of `names` closest to `typed` by optimal-string-alignment
// distance (insertions, deletions, substitutions and swaps of neighbours
// cost 1; case ignored), when that distance is at most 2 and below
// typed.size(), and no other entry is as close; nullopt otherwise (also for
// an exact match, which needs no suggestion).
// Examples: ("stauts", {"status", "stack", "up"}) -> "status";
// ("bnech", ...) -> "bench"; ("xyz", ...) -> nullopt. Pure.
std::optional<std::string> NearestName(absl::string_view typed,
                                       const std::vector<std::string>& names);

// IsCommandLineError()
//
// True for an error a command's flags caused before any work: the commands
// check their flags and flag combinations themselves and return
// kInvalidArgument with a message that starts with the flag ("--experts
// identity: not with --tp: ...", "--tls-ca \"ca.pem\": only with
// --targets"), the convention of client/*_command.cc. main.cc exits 2 for
// them, as for a flag CLI11 refuses. Errors of workers and files start with
// the call or the path, never with "--". Pure.
bool IsCommandLineError(const absl::Status& status);

}  // namespace moe_ep::client
