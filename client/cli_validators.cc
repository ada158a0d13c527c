#include "client/cli_validators.h"

#include <string>

#include "CLI/CLI.hpp"
#include "core/command_line.h"

namespace moe_ep::client {
namespace {

CLI::Validator AtLeastZero(bool strict) {
  return CLI::Validator(
      [strict](std::string& value) { return core::CheckAtLeast(value, 0, strict); },
      strict ? "POSITIVE" : "NONNEGATIVE");
}

}  // namespace

const CLI::Validator& Positive() {
  static const CLI::Validator* const kPositive = new CLI::Validator(AtLeastZero(true));
  return *kPositive;
}

const CLI::Validator& NonNegative() {
  static const CLI::Validator* const kNonNegative = new CLI::Validator(AtLeastZero(false));
  return *kNonNegative;
}

}  // namespace moe_ep::client
