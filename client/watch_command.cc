#include "client/watch_command.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/coordinator.h"
#include "client/status_command.h"
#include "client/targets.h"
#include "core/status_macros.h"

namespace moe_ep::client {
namespace {

constexpr absl::Duration kStopPoll = absl::Milliseconds(50);
constexpr const char kHomeAndClear[] = "\x1b[H\x1b[2J";

}  // namespace

absl::Status RunWatchCommand(const WatchCommandOptions& options, std::ostream& out,
                             const std::function<bool()>& stop) {
  if (options.interval_ms < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--interval-ms: expected >= 1, got ", options.interval_ms));
  }
  if (options.count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--count: expected >= 0, got ", options.count));
  }
  ASSIGN_OR_RETURN(std::vector<std::string> targets, ParseTargets(options.targets));
  CoordinatorOptions coordinator_options;
  ASSIGN_OR_RETURN(coordinator_options.channel_credentials,
                   MakeClientChannelCredentials(options.security));
  const absl::Duration interval = absl::Milliseconds(options.interval_ms);
  coordinator_options.rpc_timeout = std::max(interval, absl::Seconds(1));
  ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> coordinator,
                   Coordinator::Connect(targets, coordinator_options));
  const auto stopped = [&] { return stop && stop(); };
  for (int shown = 0; options.count == 0 || shown < options.count; ++shown) {
    if (stopped()) break;
    const absl::Time next = absl::Now() + interval;
    const auto statuses = StatusEachExplained(*coordinator);
    int unreachable = 0;
    for (const auto& s : statuses) unreachable += s.ok() ? 0 : 1;
    if (options.clear_screen) out << kHomeAndClear;
    out << "moe-ep watch: " << targets.size() << " workers (" << unreachable
        << " unreachable), every " << options.interval_ms << " ms, "
        << absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::Now(), absl::UTCTimeZone())
        << " (Ctrl-C to stop)\n"
        << RenderWorkerTable(targets, statuses, options.security) << std::flush;
    if (options.count != 0 && shown + 1 == options.count) break;
    while (absl::Now() < next && !stopped()) {
      absl::SleepFor(std::min(kStopPoll, next - absl::Now()));
    }
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::client
