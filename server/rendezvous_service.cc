#include "server/rendezvous_service.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moe_ep::server {
namespace {

// Sleep slice between checks of the call's cancellation.
constexpr absl::Duration kCancelPollInterval = absl::Milliseconds(50);

// The earlier of now + timeout_ms and the call's deadline.
absl::Time WaitDeadline(const grpc::ServerContext* context, int64_t timeout_ms) {
  absl::Time deadline = absl::Now() + absl::Milliseconds(timeout_ms);
  const auto call_deadline = context->deadline();
  if (call_deadline != std::chrono::system_clock::time_point::max()) {
    deadline = std::min(deadline, absl::FromChrono(call_deadline));
  }
  return deadline;
}

grpc::Status BadTimeout(int64_t timeout_ms) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat("timeout_ms: expected >= 0, got ", timeout_ms));
}

}  // namespace

grpc::Status RendezvousService::Set(grpc::ServerContext* /*context*/, const v1::SetRequest* request,
                                    v1::SetResponse* /*response*/) {
  if (request->key().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "key: must not be empty");
  }
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = values_.try_emplace(request->key(), request->value());
  if (!inserted && it->second != request->value()) {
    return grpc::Status(
        grpc::StatusCode::ALREADY_EXISTS,
        absl::StrCat("key \"", request->key(), "\" already holds a different value (",
                     it->second.size(), " bytes; keys are write-once)"));
  }
  if (inserted) key_added_.SignalAll();
  return grpc::Status::OK;
}

grpc::Status RendezvousService::Get(grpc::ServerContext* context, const v1::GetRequest* request,
                                    v1::GetResponse* response) {
  if (request->key().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "key: must not be empty");
  }
  if (request->timeout_ms() < 0) return BadTimeout(request->timeout_ms());
  const absl::Time deadline = WaitDeadline(context, request->timeout_ms());
  absl::MutexLock lock(&mu_);
  while (true) {
    auto it = values_.find(request->key());
    if (it != values_.end()) {
      response->set_value(it->second);
      return grpc::Status::OK;
    }
    if (context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          absl::StrCat("Get of key \"", request->key(), "\" was cancelled"));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("key \"", request->key(), "\" was not set within ",
                                       request->timeout_ms(), " ms"));
    }
    key_added_.WaitWithDeadline(&mu_, std::min(deadline, now + kCancelPollInterval));
  }
}

grpc::Status RendezvousService::Wait(grpc::ServerContext* context, const v1::WaitRequest* request,
                                     v1::WaitResponse* /*response*/) {
  for (int i = 0; i < request->keys_size(); ++i) {
    if (request->keys(i).empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("keys[", i, "]: must not be empty"));
    }
  }
  if (request->timeout_ms() < 0) return BadTimeout(request->timeout_ms());
  const absl::Time deadline = WaitDeadline(context, request->timeout_ms());
  absl::MutexLock lock(&mu_);
  while (true) {
    std::vector<std::string> missing;
    for (const std::string& key : request->keys()) {
      if (!values_.contains(key)) missing.push_back(key);
    }
    if (missing.empty()) return grpc::Status::OK;
    if (context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "Wait was cancelled");
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("keys not set within ", request->timeout_ms(), " ms: \"",
                                       absl::StrJoin(missing, "\", \""), "\""));
    }
    key_added_.WaitWithDeadline(&mu_, std::min(deadline, now + kCancelPollInterval));
  }
}

int64_t RendezvousService::NumKeys() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(values_.size());
}

}  // namespace moe_ep::server
