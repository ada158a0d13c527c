#pragma once

// `moe-ep health`: one grpc.health.v1.Health/Check of one worker, for exec
// probes and scripts (issue 8). Plaintext, on purpose: it is meant for the
// worker's --health-listen port on the pod's own loopback address, so a probe
// depends on neither DNS nor a certificate's validity (a DNS blip or a lapsed
// certificate must not restart a whole NCCL group).
//
// Service names (proto/rpc/health.h): "" is liveness (SERVING while the process
// serves), "moe_ep.v1.Worker" readiness (SERVING while joined, allocated and
// not broken).

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace moe_ep::client {

struct HealthCommandOptions {
  std::string target;   // host:port of a plaintext health port
  std::string service;  // "" (liveness) or "moe_ep.v1.Worker" (readiness)
  absl::Duration timeout = absl::Seconds(3);
};

// Calls Check once and prints "<target> <service or ""> SERVING" (or
// NOT_SERVING / SERVICE_UNKNOWN / UNKNOWN) to `out`.
// Returns OK only for SERVING.
// Errors: kInvalidArgument for an empty target or a timeout <= 0;
// kUnavailable when the status is not SERVING (the message names it); the
// RPC's own code (e.g. kDeadlineExceeded, kUnavailable, kNotFound for a name
// the server does not know) when the call fails.
absl::Status RunHealthCommand(const HealthCommandOptions& options, std::ostream& out);

}  // namespace moe_ep::client
