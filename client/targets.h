#pragma once

// Worker target addresses ("host:port") as given on the command line
// (`--targets 10.0.0.1:50051,10.0.0.2:50051`). Rank i is the i-th target.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe_ep::client {

struct HostPort {
  std::string host;  // without IPv6 brackets: "127.0.0.1", "::1", "worker-0"
  int port = 0;      // 1..65535
};

// Splits "host:port" or "[ipv6]:port".
// Errors: kInvalidArgument naming the target when the colon, host or port is
// missing, or the port is not an integer in 1..65535.
absl::StatusOr<HostPort> SplitHostPort(absl::string_view target);

// Parses a comma-separated target list; surrounding spaces are ignored.
// Errors: kInvalidArgument when the list is empty, an entry is malformed (see
// SplitHostPort; the message names the entry's position), or an address
// appears twice (two ranks cannot share one worker).
absl::StatusOr<std::vector<std::string>> ParseTargets(absl::string_view list);

// A rank list for a message, runs of 3 or more as ranges: {0,1,2,3} -> "0-3",
// {0,2,5} -> "0, 2, 5", {1,2} -> "1, 2". REQUIRES: ascending.
std::string FormatRankList(const std::vector<int>& ranks);

}  // namespace moe_ep::client
