#pragma once

// The moe_ep.v1.Rendezvous service (proto/moe_ep/v1/rendezvous.proto): an
// in-memory write-once key-value store that every worker serves; a group uses
// rank 0's to form its communicator (Gloo addresses, the NCCL unique id).
// Keys carry a per-generation prefix ("gen<N>/..."), so a re-formed group
// never reuses a key.
//
// Set:  stores a value; same value again is OK (idempotent), a different
//       value is ALREADY_EXISTS naming the key. Empty key: INVALID_ARGUMENT.
// Get:  waits up to min(timeout_ms, the call's deadline) for the key;
//       DEADLINE_EXCEEDED names the key; timeout_ms < 0: INVALID_ARGUMENT;
//       timeout_ms == 0 checks once without waiting.
// Wait: as Get for a list of keys; DEADLINE_EXCEEDED lists (the first few of)
//       the missing keys.
// A cancelled call (client gone, server shutting down) returns CANCELLED.
//
// Limits (issue 13 item 10; StoreLimits, flags --store-max-*): key and value
// sizes and the keys of one Wait are INVALID_ARGUMENT beyond them; the
// number of keys and the bytes held are RESOURCE_EXHAUSTED beyond them (the
// byte budget is carved out of the worker's memory cap, server/main.cc).
// Error messages stay short (no key is quoted past 64 bytes).
//
// Who may write (with StoreLimits::require_open_generation, as the worker
// runs it): only keys "gen<N>/..." of a generation this worker opened with
// OpenGeneration (its Join as rank 0 of generation N). A Set of a generation
// not opened yet is UNAVAILABLE (GrpcStore retries it: rank 0 may join after
// its peers); of an older generation FAILED_PRECONDITION. When the opened
// generation has a secret (JoinRequest.rendezvous_secret), a Set must carry
// it in the metadata kSecretMetadataKey, else PERMISSION_DENIED. Once a
// newer generation has formed, DropGenerationsBelow frees the older keys.
//
// Thread-safe: many handler threads share the map under one absl::Mutex;
// waiters sleep on a CondVar signalled by Set. Source: DESIGN §8; issue 13.

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "core/arrival_board.h"
#include "moe_ep/v1/rendezvous.grpc.pb.h"
#include "server/store_limits.h"

namespace moe_ep::server {

class RendezvousService final : public v1::Rendezvous::Service {
 public:
  explicit RendezvousService(StoreLimits limits = {});

  grpc::Status Set(grpc::ServerContext* context, const v1::SetRequest* request,
                   v1::SetResponse* response) override;
  grpc::Status Get(grpc::ServerContext* context, const v1::GetRequest* request,
                   v1::GetResponse* response) override;
  grpc::Status Wait(grpc::ServerContext* context, const v1::WaitRequest* request,
                    v1::WaitResponse* response) override;
  // The arrival round of a collective call (core/arrival_board.h; issue 29):
  // checked as a Set of `round` (generation open, secret), then ARRIVE /
  // WITHDRAW / REFUSE on the board. INVALID_ARGUMENT for a rank or member
  // outside [0, 65536), no members, timeout_ms < 0 or refusal_ttl_ms < 0.
  grpc::Status Arrive(grpc::ServerContext* context, const v1::ArriveRequest* request,
                      v1::ArriveResponse* response) override;

  // Accepts writes of generation `generation` from now on (and of no older
  // one); `secret` non-empty: each Set must carry it. Called by the worker
  // when it joins as rank 0, before its group forms.
  void OpenGeneration(int64_t generation, const std::string& secret);
  // Frees the keys of every generation < `generation` (called once that
  // generation has formed). Keys without a "gen<N>/" prefix stay.
  void DropGenerationsBelow(int64_t generation);

  // Number of keys stored, and their bytes (keys + values; for tests and status).
  int64_t NumKeys() const;
  int64_t StoredBytes() const;

 private:
  grpc::Status CheckWriter(const grpc::ServerContext* context, const std::string& key) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // As CheckWriter for an arrival round: any generation opened here and not
  // dropped yet counts (a Join of a newer generation that failed leaves the
  // group in force, whose calls still meet here), with that generation's
  // secret.
  grpc::Status CheckArrival(const grpc::ServerContext* context, const std::string& round) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StoreLimits limits_;
  mutable absl::Mutex mu_;
  absl::CondVar key_added_;
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  int64_t stored_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t open_generation_ ABSL_GUARDED_BY(mu_) = 0;  // 0 = none yet
  std::string open_secret_ ABSL_GUARDED_BY(mu_);
  // Every generation opened and not dropped, with its secret (CheckArrival).
  absl::flat_hash_map<int64_t, std::string> opened_ ABSL_GUARDED_BY(mu_);
  core::ArrivalBoard board_;  // its own lock: Arrive waits on it, not on mu_
};

// GenerationOfKey()
//
// N of a key "gen<N>/...", or -1 when the key has no such prefix.
int64_t GenerationOfKey(const std::string& key);

}  // namespace moe_ep::server
