#include "client/unsent_retry.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "absl/strings/match.h"

namespace moe_ep::client {

bool FailedBeforeSending(const grpc::Status& status) {
  // gRPC's own status begins with it; a worker's answer may quote it further
  // in (a host error naming rank 0's store: server/call_arrival.cc), and
  // that call did run.
  return status.error_code() == grpc::StatusCode::UNAVAILABLE &&
         absl::StartsWith(status.error_message(), "failed to connect to all addresses");
}

bool FailedBeforeSendingTransiently(const grpc::Status& status) {
  return FailedBeforeSending(status) &&
         !absl::StrContains(status.error_message(), "Connection refused");
}

grpc::Status CallRetryingUnsent(grpc::Channel& channel,
                                std::chrono::system_clock::time_point deadline,
                                absl::Duration connect_grace,
                                const std::function<grpc::Status(grpc::ClientContext*)>& call) {
  grpc::Status status;
  {
    grpc::ClientContext context;
    context.set_deadline(deadline);
    status = call(&context);
  }
  if (!FailedBeforeSendingTransiently(status)) return status;
  const auto grace_end = std::chrono::system_clock::now() +
                         std::chrono::duration_cast<std::chrono::system_clock::duration>(
                             absl::ToChronoNanoseconds(connect_grace));
  if (!channel.WaitForConnected(std::min(deadline, grace_end))) return status;
  // Connected with no time left to send: the first failure says more than
  // a bare DEADLINE_EXCEEDED would.
  if (deadline - std::chrono::system_clock::now() < std::chrono::milliseconds(5)) return status;
  grpc::ClientContext context;
  context.set_deadline(deadline);
  return call(&context);
}

absl::Duration ConnectGrace(absl::Duration reconnect_backoff) {
  const absl::Duration backoff =
      reconnect_backoff > absl::ZeroDuration() ? reconnect_backoff : absl::Seconds(1);
  return backoff * 1.2 + absl::Seconds(1);
}

}  // namespace moe_ep::client
