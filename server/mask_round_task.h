#pragma once

// One rank mask round run on a thread of its own (DESIGN §15; issue 17 item
// 3): what DataPlane::BeginMaskRound starts and FinishMaskRound waits for.
// The thread runs AgreeRankMask on its own copy of the MaskRound and touches
// nothing else. Stopping a running task (Stop, or destroying it: a Leave, or
// a data plane going away mid-round) sets the round's stop flag, so the
// round's store waits return within about GrpcStore::kStopCheckInterval plus
// an RPC's slack (server/grpc_store.h) instead of waiting out their
// timeouts; a Gloo connect (GlooCollective::Create) or a liveness probe
// already under way does not look at the flag and runs to its own bound
// (the round's timeout; 500 ms a probe), so Stop can take up to one group
// timeout. It then joins the thread: nothing of the round outlives the task.
// Stopping a rank mid-round can break the other ranks' round (a member that
// announced itself never forms the context; a host takes its store away):
// they see a group error and run the next round.
// Not thread-safe (its data plane's owner serializes the calls).

#include <atomic>
#include <future>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/rank_mask.h"

namespace moe_ep::server {

class MaskRoundTask {
 public:
  MaskRoundTask() = default;
  // Stops a running round (Stop).
  ~MaskRoundTask();
  MaskRoundTask(const MaskRoundTask&) = delete;
  MaskRoundTask& operator=(const MaskRoundTask&) = delete;

  // Starts `round` (its stop flag replaced by the task's) on a new thread.
  // REQUIRES: !running().
  void Start(MaskRound round);

  // Whether a round was started and its result not taken (by Wait) or
  // dropped (by Stop) yet.
  bool running() const { return result_.valid(); }

  // Waits up to `wait` for the running round: nullopt while it still runs
  // (or none runs); else its result (AgreeRankMask's), and the task is idle
  // again.
  std::optional<absl::StatusOr<MaskAgreement>> Wait(absl::Duration wait);

  // Makes a running round give up (kCancelled at its next check), waits for
  // its thread and drops its result; the task is idle again. Returns at once
  // when none runs.
  void Stop();

 private:
  std::shared_ptr<std::atomic<bool>> stop_;            // the running round's
  std::future<absl::StatusOr<MaskAgreement>> result_;  // valid while running
};

}  // namespace moe_ep::server
