#include "core/stop_check.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace moe_ep::core {
namespace {

constexpr absl::string_view kLocalStopPayload = "type.moe-ep/moe_ep.core.LocalStop";

}  // namespace

absl::Status LocalStop(absl::string_view what) {
  absl::Status stop = absl::CancelledError(
      absl::StrCat(what,
                   ": stopped early on this rank (its call's deadline passed or its client "
                   "cancelled it); nothing was kept"));
  stop.SetPayload(kLocalStopPayload, absl::Cord("1"));
  return stop;
}

bool IsLocalStop(const absl::Status& status) {
  return status.GetPayload(kLocalStopPayload).has_value();
}

}  // namespace moe_ep::core
