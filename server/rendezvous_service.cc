#include "server/rendezvous_service.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace moe_ep::server {
namespace {

// Sleep slice between checks of the call's cancellation.
constexpr absl::Duration kCancelPollInterval = absl::Milliseconds(50);
// Keys quoted in an error message, and bytes of each.
constexpr size_t kQuotedKeys = 8;
constexpr size_t kQuotedKeyBytes = 64;

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

// `key` quoted, cut to kQuotedKeyBytes.
std::string Quote(const std::string& key) {
  if (key.size() <= kQuotedKeyBytes) return absl::StrCat("\"", key, "\"");
  return absl::StrCat("\"", key.substr(0, kQuotedKeyBytes), "...\" (", key.size(), " bytes)");
}

// Equal without an early exit (the time does not tell how much matched).
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

grpc::Status CheckKey(const std::string& key, absl::string_view field, int64_t max_bytes) {
  if (key.empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(field, ": must not be empty"));
  }
  if (static_cast<int64_t>(key.size()) > max_bytes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(field, ": expected <= ", max_bytes,
                                     " bytes (--store-max-key-bytes), got ", key.size()));
  }
  return grpc::Status::OK;
}

}  // namespace

int64_t GenerationOfKey(const std::string& key) {
  if (!absl::StartsWith(key, "gen")) return -1;
  const size_t slash = key.find('/');
  if (slash == std::string::npos || slash == 3) return -1;
  int64_t generation = 0;
  if (!absl::SimpleAtoi(absl::string_view(key).substr(3, slash - 3), &generation) ||
      generation < 0) {
    return -1;
  }
  return generation;
}

RendezvousService::RendezvousService(StoreLimits limits) : limits_(limits) {}

grpc::Status RendezvousService::CheckWriter(const grpc::ServerContext* context,
                                            const std::string& key) const {
  if (!limits_.require_open_generation) return grpc::Status::OK;
  const int64_t generation = GenerationOfKey(key);
  if (generation < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("key ", Quote(key), ": expected the prefix \"gen<N>/\""));
  }
  if (generation > open_generation_) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat("generation ", generation,
                                     " is not open on this store yet (its rank 0 has not joined "
                                     "it; the store's newest is ",
                                     open_generation_, ")"));
  }
  if (generation < open_generation_) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("generation ", generation, " is closed: this store serves ",
                                     open_generation_));
  }
  if (!open_secret_.empty()) {
    const auto& metadata = context->client_metadata();
    auto it = metadata.find(kSecretMetadataKey);
    const std::string sent =
        it == metadata.end() ? "" : std::string(it->second.data(), it->second.size());
    if (!SameSecret(sent, open_secret_)) {
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          absl::StrCat("Set of generation ", generation,
                                       ": the rendezvous secret is missing or wrong (only the "
                                       "group's members may write)"));
    }
  }
  return grpc::Status::OK;
}

grpc::Status RendezvousService::CheckArrival(const grpc::ServerContext* context,
                                             const std::string& round) const {
  if (!limits_.require_open_generation) return grpc::Status::OK;
  const int64_t generation = GenerationOfKey(round);
  if (generation < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("round ", Quote(round), ": expected the prefix \"gen<N>/\""));
  }
  auto it = opened_.find(generation);
  if (it == opened_.end()) {
    if (generation > open_generation_) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          absl::StrCat("generation ", generation,
                                       " is not open on this store yet (the store's newest is ",
                                       open_generation_, ")"));
    }
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("generation ", generation, " is closed: a newer group formed on this store"));
  }
  if (!it->second.empty()) {
    const auto& metadata = context->client_metadata();
    auto sent = metadata.find(kSecretMetadataKey);
    const std::string given =
        sent == metadata.end() ? "" : std::string(sent->second.data(), sent->second.size());
    if (!SameSecret(given, it->second)) {
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          absl::StrCat("Arrive of generation ", generation,
                                       ": the rendezvous secret is missing or wrong (only the "
                                       "group's members may take part)"));
    }
  }
  return grpc::Status::OK;
}

grpc::Status RendezvousService::Set(grpc::ServerContext* context, const v1::SetRequest* request,
                                    v1::SetResponse* /*response*/) {
  if (grpc::Status key = CheckKey(request->key(), "key", limits_.max_key_bytes); !key.ok()) {
    return key;
  }
  if (static_cast<int64_t>(request->value().size()) > limits_.max_value_bytes) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("value: expected <= ", limits_.max_value_bytes,
                     " bytes (--store-max-value-bytes), got ", request->value().size()));
  }
  const int64_t bytes = static_cast<int64_t>(request->key().size() + request->value().size());
  absl::MutexLock lock(&mu_);
  if (grpc::Status writer = CheckWriter(context, request->key()); !writer.ok()) return writer;
  auto it = values_.find(request->key());
  if (it != values_.end()) {
    if (it->second == request->value()) return grpc::Status::OK;
    return grpc::Status(
        grpc::StatusCode::ALREADY_EXISTS,
        absl::StrCat("key ", Quote(request->key()), " already holds a different value (",
                     it->second.size(), " bytes; keys are write-once)"));
  }
  if (static_cast<int64_t>(values_.size()) >= limits_.max_keys) {
    return grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("the store holds ", values_.size(), " keys, its limit (--store-max-keys)"));
  }
  if (stored_bytes_ + bytes > limits_.max_total_bytes) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("the store holds ", stored_bytes_, " bytes; ", bytes,
                                     " more would pass its limit of ", limits_.max_total_bytes,
                                     " (--store-max-bytes, part of the memory cap)"));
  }
  values_.emplace(request->key(), request->value());
  stored_bytes_ += bytes;
  key_added_.SignalAll();
  return grpc::Status::OK;
}

grpc::Status RendezvousService::Get(grpc::ServerContext* context, const v1::GetRequest* request,
                                    v1::GetResponse* response) {
  if (grpc::Status key = CheckKey(request->key(), "key", limits_.max_key_bytes); !key.ok()) {
    return key;
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
                          absl::StrCat("Get of key ", Quote(request->key()), " was cancelled"));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("key ", Quote(request->key()), " was not set within ",
                                       request->timeout_ms(), " ms"));
    }
    key_added_.WaitWithDeadline(&mu_, std::min(deadline, now + kCancelPollInterval));
  }
}

grpc::Status RendezvousService::Wait(grpc::ServerContext* context, const v1::WaitRequest* request,
                                     v1::WaitResponse* /*response*/) {
  if (request->keys_size() > limits_.max_wait_keys) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("keys: expected <= ", limits_.max_wait_keys,
                                     " (--store-max-wait-keys), got ", request->keys_size()));
  }
  for (int i = 0; i < request->keys_size(); ++i) {
    if (grpc::Status key =
            CheckKey(request->keys(i), absl::StrCat("keys[", i, "]"), limits_.max_key_bytes);
        !key.ok()) {
      return key;
    }
  }
  if (request->timeout_ms() < 0) return BadTimeout(request->timeout_ms());
  const absl::Time deadline = WaitDeadline(context, request->timeout_ms());
  absl::MutexLock lock(&mu_);
  while (true) {
    std::vector<std::string> missing;
    size_t num_missing = 0;
    for (const std::string& key : request->keys()) {
      if (values_.contains(key)) continue;
      if (++num_missing <= kQuotedKeys) missing.push_back(Quote(key));
    }
    if (num_missing == 0) return grpc::Status::OK;
    if (context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "Wait was cancelled");
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return grpc::Status(
          grpc::StatusCode::DEADLINE_EXCEEDED,
          absl::StrCat(num_missing, " key(s) not set within ", request->timeout_ms(),
                       " ms: ", absl::StrJoin(missing, ", "),
                       num_missing > missing.size()
                           ? absl::StrCat(" and ", num_missing - missing.size(), " more")
                           : ""));
    }
    key_added_.WaitWithDeadline(&mu_, std::min(deadline, now + kCancelPollInterval));
  }
}

grpc::Status RendezvousService::Arrive(grpc::ServerContext* context,
                                       const v1::ArriveRequest* request,
                                       v1::ArriveResponse* response) {
  if (grpc::Status key = CheckKey(request->round(), "round", limits_.max_key_bytes); !key.ok()) {
    return key;
  }
  constexpr int kMaxRank = 65536;
  const auto bad_rank = [&](int rank) { return rank < 0 || rank >= kMaxRank; };
  if (bad_rank(request->rank())) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("rank: expected in [0, ", kMaxRank, "), got ", request->rank()));
  }
  if (request->members_size() == 0 || request->members_size() > kMaxRank) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("members: expected 1 to ", kMaxRank, " ranks, got ", request->members_size()));
  }
  for (int i = 0; i < request->members_size(); ++i) {
    if (bad_rank(request->members(i))) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("members[", i, "]: expected in [0, ", kMaxRank, "), got ",
                                       request->members(i)));
    }
  }
  if (request->timeout_ms() < 0) return BadTimeout(request->timeout_ms());
  if (request->lapses_in_ms() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("lapses_in_ms: expected >= 0, got ", request->lapses_in_ms()));
  }
  if (request->refusal_ttl_ms() < 0) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("refusal_ttl_ms: expected >= 0, got ", request->refusal_ttl_ms()));
  }
  if (static_cast<int64_t>(request->address().size() + request->refusal().size()) >
      limits_.max_value_bytes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("address + refusal: expected <= ", limits_.max_value_bytes,
                                     " bytes (--store-max-value-bytes)"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (grpc::Status writer = CheckArrival(context, request->round()); !writer.ok()) {
      return writer;
    }
  }
  absl::StatusOr<core::ArrivalOutcome> outcome;
  switch (request->action()) {
    case v1::ArriveRequest::ACTION_REFUSE: {
      const absl::Status refused =
          board_.Refuse(request->round(), request->rank(), request->refusal(),
                        absl::Now() + absl::Milliseconds(request->refusal_ttl_ms()));
      if (!refused.ok()) {
        return grpc::Status(static_cast<grpc::StatusCode>(refused.code()),
                            std::string(refused.message()));
      }
      return grpc::Status::OK;
    }
    case v1::ArriveRequest::ACTION_WITHDRAW:
      outcome = board_.Withdraw(request->round(), request->rank());
      break;
    default: {
      const std::vector<int> members(request->members().begin(), request->members().end());
      const absl::Time lapses = request->lapses_in_ms() > 0
                                    ? absl::Now() + absl::Milliseconds(request->lapses_in_ms())
                                    : absl::InfiniteFuture();
      outcome = board_.Arrive(
          request->round(), request->rank(), members, request->address(),
          WaitDeadline(context, request->timeout_ms()),
          [context] { return context->IsCancelled(); }, lapses);
      break;
    }
  }
  if (!outcome.ok()) {
    return grpc::Status(static_cast<grpc::StatusCode>(outcome.status().code()),
                        std::string(outcome.status().message()));
  }
  response->set_complete(outcome->complete);
  response->mutable_missing()->Assign(outcome->missing.begin(), outcome->missing.end());
  for (const std::string& address : outcome->missing_addresses) {
    response->add_missing_addresses(address);
  }
  response->set_refused_rank(outcome->refused_rank);
  response->set_refusal(outcome->refusal);
  return grpc::Status::OK;
}

void RendezvousService::OpenGeneration(int64_t generation, const std::string& secret) {
  absl::MutexLock lock(&mu_);
  if (generation < open_generation_) return;
  open_generation_ = generation;
  open_secret_ = secret;
  opened_[generation] = secret;
}

void RendezvousService::DropGenerationsBelow(int64_t generation) {
  board_.DropGenerationsBelow(generation);
  absl::MutexLock lock(&mu_);
  for (auto it = opened_.begin(); it != opened_.end();) {
    if (it->first < generation) {
      opened_.erase(it++);
    } else {
      ++it;
    }
  }
  for (auto it = values_.begin(); it != values_.end();) {
    const int64_t g = GenerationOfKey(it->first);
    if (g >= 0 && g < generation) {
      stored_bytes_ -= static_cast<int64_t>(it->first.size() + it->second.size());
      values_.erase(it++);
    } else {
      ++it;
    }
  }
}

int64_t RendezvousService::NumKeys() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(values_.size());
}

int64_t RendezvousService::StoredBytes() const {
  absl::MutexLock lock(&mu_);
  return stored_bytes_;
}

}  // namespace moe_ep::server
