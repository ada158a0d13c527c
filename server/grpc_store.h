#pragma once

// A gloo::rendezvous::Store backed by the Rendezvous service of rank 0's
// worker (server/rendezvous_service.h), reached over gRPC. Gloo's rendezvous
// Context uses it to exchange the ranks' TCP addresses (DESIGN §8: "Gloo uses
// the store as its Store, under a prefix per generation").
//
// Every call retries while rank 0 is not up yet (UNAVAILABLE: its worker may
// start later than this one) until the store's timeout has passed. Gloo
// expects exceptions from a Store, so failures throw gloo::IoException:
//   - timeout: the message contains "Timed out" and names the key(s) and the
//     address (core/gloo_collective.cc maps it to kDeadlineExceeded);
//   - any other RPC error (ALREADY_EXISTS for a reused key, INVALID_ARGUMENT):
//     the gRPC code and message (mapped to kUnavailable there).
//
// Thread-safe (gRPC stubs are); Gloo calls it from one thread.

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gloo/rendezvous/store.h"
#include "grpcpp/security/credentials.h"
#include "moe_ep/v1/rendezvous.grpc.pb.h"
#include "moe_ep/v1/worker.grpc.pb.h"

namespace moe_ep::server {

// The channel credentials every GrpcStore created afterwards uses to reach
// rank 0 (TLS, client certificate, bearer token: proto/rpc/tls_credentials.h's
// rpc::MakePeerChannelCredentials). Process-wide because it is process
// configuration (main.cc sets it once from the flags, before serving); null
// (the default) means plaintext. Thread-safe.
void SetPeerChannelCredentials(std::shared_ptr<grpc::ChannelCredentials> credentials);

// Whether `status` of a call on a GrpcStore channel says the peer accepted
// the TCP connection but sent nothing (stopped or overloaded, not gone):
// UNAVAILABLE "... timed out before receiving SETTINGS frame" (gRPC 1.51).
// A refused or timed-out TCP connect is not.
bool IsUnansweredHandshake(const grpc::Status& status);

class GrpcStore : public gloo::rendezvous::Store {
 public:
  // `address` is host:port of the Rendezvous service; `timeout` bounds each
  // set/get/wait (and wait(keys, timeout) uses its own timeout, or this one
  // when Gloo passes zero = "no timeout"). `secret` non-empty: sent with
  // every call as the generation's rendezvous secret (kSecretMetadataKey of
  // server/rendezvous_service.h). `stop` non-null (a rank mask round,
  // server/rank_mask.h): each RPC waits at most kStopCheckInterval plus its
  // slack before the call looks at the flag again, and a set flag ends the
  // call with a gloo::IoException saying "stopped". REQUIRES: timeout > 0.
  GrpcStore(std::string address, absl::Duration timeout, std::string secret = "",
            std::shared_ptr<const std::atomic<bool>> stop = nullptr);

  // How long one RPC of a store with a stop flag waits on the server.
  static constexpr absl::Duration kStopCheckInterval = absl::Milliseconds(100);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  const std::string& address() const { return address_; }

  // Answers()
  //
  // One call without retries: whether the Rendezvous service at address()
  // answers within `timeout` (any reply but UNAVAILABLE). A killed worker's
  // port refuses at once on loopback, so this tells a lost rank from a live
  // one (server/rank_mask.h). Never throws. Thread-safe.
  bool Answers(absl::Duration timeout);

  // Poll()
  //
  // One Get without waiting or retries: true and the value in *value when
  // `key` is stored, false when it is not or the service does not answer
  // within `timeout`. Never throws. Thread-safe.
  bool Poll(const std::string& key, absl::Duration timeout, std::string* value);

  // How a Rendezvous service answered a probe (Probe()).
  enum class ProbeResult { kAnswers, kRefuses, kSilent };
  // Probe()
  //
  // As Answers(), telling a port that refuses (kRefuses: the worker is gone;
  // UNAVAILABLE before `timeout`) from one that says nothing within
  // `timeout` (kSilent: stopped or overloaded). Never throws. Thread-safe.
  ProbeResult Probe(absl::Duration timeout);

  // Arrive()
  //
  // One Rendezvous.Arrive RPC (proto/moe_ep/v1/rendezvous.proto; the
  // arrival round of a collective call, server/call_arrival.h), without
  // retries, with the secret, bounded by `request.timeout_ms()` plus a
  // slack. Returns the RPC's status. Never throws. Thread-safe.
  grpc::Status Arrive(const v1::ArriveRequest& request, v1::ArriveResponse* response);

  // PeerStatus()
  //
  // One Worker.GetStatus of the worker serving address() (the same port as
  // its Rendezvous service), without retries, within `timeout`: whether a
  // peer that answers is still a member of the caller's group (its
  // generation, state and group_broken). Returns the RPC's error as a
  // Status. Never throws. Thread-safe.
  absl::StatusOr<v1::GetStatusResponse> PeerStatus(absl::Duration timeout);

 private:
  std::string address_;
  absl::Duration timeout_;
  std::string secret_;
  std::shared_ptr<const std::atomic<bool>> stop_;
  std::unique_ptr<v1::Rendezvous::Stub> stub_;
  std::unique_ptr<v1::Worker::Stub> worker_;
};

}  // namespace moe_ep::server
