#pragma once

// Where the ranks of a desired state are (DESIGN §16, issue 12 item 5): the
// listed targets, or the pods behind a Kubernetes headless Service. The
// coordinator service takes a TargetResolver so that tests can point it at
// loopback addresses.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moe_ep/v1/coordinator.pb.h"

namespace moe_ep::client {

namespace v1 = ::moe_ep::v1;

// Resolves a host name to its addresses (IPv4/IPv6 text). Errors:
// kUnavailable naming the host when it does not resolve (yet).
using HostLookup = std::function<absl::StatusOr<std::vector<std::string>>(const std::string& host)>;

// getaddrinfo(3) (TCP, any family). Thread-safe.
HostLookup SystemHostLookup();

// HeadlessServiceTargets()
//
// The per-rank targets of `service` in rank order: pod p of replicas, local
// process l of procs_per_pod (0 = 1), is rank p * P + l at
// "<pod_prefix>-<p>.<service>:<port + p * port_step + l>" (pod_prefix empty:
// the first label of service). The stable per-pod DNS names of a
// StatefulSet's headless Service, which the workers' certificates name
// (deploy/README.md), so TLS keeps verifying across pod replacements.
// Example: {service "moe-ep-worker", replicas 2, port 50051} ->
// ["moe-ep-worker-0.moe-ep-worker:50051", "moe-ep-worker-1.moe-ep-worker:50051"].
// REQUIRES: ValidateDesiredState accepts the headless_service. Pure.
std::vector<std::string> HeadlessServiceTargets(const v1::HeadlessService& service);

class TargetResolver {
 public:
  virtual ~TargetResolver() = default;
  // The targets of `state` in rank order. Called by the coordinator before
  // every formation attempt; a result that differs from the last one makes
  // the next formation use the new targets. Must be thread-safe.
  virtual absl::StatusOr<std::vector<std::string>> Resolve(const v1::DesiredState& state) = 0;
};

// `state.targets` as given; for headless_service, HeadlessServiceTargets()
// once every pod name resolves through `lookup` (a pod that is not in DNS yet
// does not exist or has no address: forming without it would fail anyway).
// Errors: kUnavailable naming the first pod name that does not resolve.
class DefaultTargetResolver : public TargetResolver {
 public:
  explicit DefaultTargetResolver(HostLookup lookup = SystemHostLookup())
      : lookup_(std::move(lookup)) {}
  absl::StatusOr<std::vector<std::string>> Resolve(const v1::DesiredState& state) override;

 private:
  HostLookup lookup_;
};

}  // namespace moe_ep::client
