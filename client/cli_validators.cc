#include "client/cli_validators.h"

#include <algorithm>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "core/command_line.h"

namespace moe_ep::client {
namespace {

CLI::Validator AtLeastZero(bool strict) {
  return CLI::Validator(
      [strict](std::string& value) { return core::CheckAtLeast(value, 0, strict); },
      strict ? "POSITIVE" : "NONNEGATIVE");
}

// Optimal string alignment distance of two lowercase strings.
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
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

std::optional<std::string> NearestName(absl::string_view typed,
                                       const std::vector<std::string>& names) {
  const std::string t = absl::AsciiStrToLower(typed);
  std::optional<std::string> best;
  size_t best_distance = 3;  // at most 2 counts
  bool tie = false;
  for (const std::string& name : names) {
    const size_t d = EditDistance(t, absl::AsciiStrToLower(name));
    if (d == 0) return std::nullopt;
    if (d < best_distance) {
      best = name;
      best_distance = d;
      tie = false;
    } else if (d == best_distance) {
      tie = true;
    }
  }
  if (!best.has_value() || tie || best_distance >= t.size()) return std::nullopt;
  return best;
}

bool IsCommandLineError(const absl::Status& status) {
  return absl::IsInvalidArgument(status) && absl::StartsWith(status.message(), "--");
}

}  // namespace moe_ep::client
