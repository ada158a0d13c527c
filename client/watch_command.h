#pragma once

// `moe-ep watch --targets h:p,... [--interval-ms MS]`: the `moe-ep status`
// table (client/status_command.h), refreshed every interval until Ctrl-C (or
// `count` refreshes). Each refresh asks every worker for GetStatus in
// parallel with a deadline of max(interval, 1 s); a worker that does not
// answer shows as UNREACHABLE with its error, and the watch goes on.
// Source: issue 5 ("moe-ep watch refreshes it").

#include <functional>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "client/credentials.h"

namespace moe_ep::client {

struct WatchCommandOptions {
  std::string targets;  // comma-separated host:port list, rank order
  int interval_ms = 1000;
  int count = 0;  // refreshes to show; 0 = until `stop` says so
  // ANSI "home + clear" before each table. `moe-ep watch` sets it only when
  // stdout is a terminal (and not --no-clear): a pipe or a file gets plain
  // tables one after the other (issue 31 item 1).
  bool clear_screen = true;
  ClientSecurityOptions security;
};

// Prints a header line (worker count, interval, UTC time) and the table every
// interval. `stop` (checked every 50 ms; empty = never) ends the watch early.
// Returns OK when stopped or after `count` refreshes.
// Errors: kInvalidArgument for interval_ms < 1, count < 0, a bad target list
// or bad security options (client/credentials.h).
absl::Status RunWatchCommand(const WatchCommandOptions& options, std::ostream& out,
                             const std::function<bool()>& stop);

}  // namespace moe_ep::client
