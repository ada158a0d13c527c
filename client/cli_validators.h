#pragma once

// CLI11 range checks of `moe-ep` whose message a person can read (issue 9
// item 5): CLI11's PositiveNumber / NonNegativeNumber print their upper bound,
// DBL_MAX, as a 309-digit number; these say "--tokens: expected a number > 0,
// got -3". The wording comes from core/command_line.h, which the worker's
// flags share. Thread-safe (immutable validators).

#include "CLI/CLI.hpp"

namespace moe_ep::client {

// A number > 0 ("expected a number > 0, got 0").
const CLI::Validator& Positive();

// A number >= 0 ("expected a number >= 0, got -1").
const CLI::Validator& NonNegative();

}  // namespace moe_ep::client
