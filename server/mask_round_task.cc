#include "server/mask_round_task.h"

#include <chrono>
#include <utility>

namespace moe_ep::server {

MaskRoundTask::~MaskRoundTask() { Stop(); }

void MaskRoundTask::Start(MaskRound round) {
  stop_ = std::make_shared<std::atomic<bool>>(false);
  round.stop = stop_;
  result_ =
      std::async(std::launch::async, [round = std::move(round)] { return AgreeRankMask(round); });
}

std::optional<absl::StatusOr<MaskAgreement>> MaskRoundTask::Wait(absl::Duration wait) {
  if (!result_.valid() ||
      result_.wait_for(absl::ToChronoMilliseconds(wait)) != std::future_status::ready) {
    return std::nullopt;
  }
  return result_.get();
}

void MaskRoundTask::Stop() {
  if (!result_.valid()) return;
  stop_->store(true);
  // The round returns promptly now; its result (a members' group, perhaps)
  // is dropped with the future.
  result_.wait();
  result_ = {};
}

}  // namespace moe_ep::server
