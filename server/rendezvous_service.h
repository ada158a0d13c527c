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
// Wait: as Get for a list of keys; DEADLINE_EXCEEDED lists the missing keys.
// A cancelled call (client gone, server shutting down) returns CANCELLED.
//
// Thread-safe: many handler threads share the map under one absl::Mutex;
// waiters sleep on a CondVar signalled by Set. Source: DESIGN §8.

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "moe_ep/v1/rendezvous.grpc.pb.h"

namespace moe_ep::server {

class RendezvousService final : public v1::Rendezvous::Service {
 public:
  grpc::Status Set(grpc::ServerContext* context, const v1::SetRequest* request,
                   v1::SetResponse* response) override;
  grpc::Status Get(grpc::ServerContext* context, const v1::GetRequest* request,
                   v1::GetResponse* response) override;
  grpc::Status Wait(grpc::ServerContext* context, const v1::WaitRequest* request,
                    v1::WaitResponse* response) override;

  // Number of keys stored (for tests and status).
  int64_t NumKeys() const;

 private:
  mutable absl::Mutex mu_;
  absl::CondVar key_added_;
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe_ep::server
