#include "client/targets.h"

#include <set>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace moe_ep::client {

absl::StatusOr<HostPort> SplitHostPort(absl::string_view target) {
  HostPort out;
  absl::string_view port_text;
  if (absl::StartsWith(target, "[")) {
    const size_t close = target.find(']');
    if (close == absl::string_view::npos || close + 1 >= target.size() ||
        target[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat("target '", target, "': expected [ipv6]:port"));
    }
    out.host = std::string(target.substr(1, close - 1));
    port_text = target.substr(close + 2);
  } else {
    const size_t colon = target.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("target '", target, "': expected host:port, got no ':'"));
    }
    out.host = std::string(target.substr(0, colon));
    port_text = target.substr(colon + 1);
  }
  if (out.host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("target '", target, "': host is empty"));
  }
  if (!absl::SimpleAtoi(port_text, &out.port) || out.port < 1 || out.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("target '", target, "': port '", port_text,
                                                   "' is not an integer in 1..65535"));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> ParseTargets(absl::string_view list) {
  std::vector<std::string> targets;
  std::set<std::string> seen;
  int index = 0;
  for (absl::string_view entry : absl::StrSplit(list, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--targets entry ", index, " is empty (list '", list, "')"));
    }
    auto hp = SplitHostPort(entry);
    if (!hp.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--targets entry ", index, ": ", hp.status().message()));
    }
    if (!seen.insert(std::string(entry)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--targets entry ", index, ": '", entry,
                       "' appears twice; each rank needs its own worker"));
    }
    targets.emplace_back(entry);
    ++index;
  }
  return targets;
}

std::string FormatRankList(const std::vector<int>& ranks) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    parts.push_back(j >= i + 2 ? absl::StrCat(ranks[i], "-", ranks[j])
                               : absl::StrJoin(ranks.begin() + i, ranks.begin() + j + 1, ", "));
    i = j + 1;
  }
  return absl::StrJoin(parts, ", ");
}

}  // namespace moe_ep::client
