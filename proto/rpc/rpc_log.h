#pragma once

// One log line per RPC a gRPC server answers (issue 31 item 5), from a
// server interceptor, through spdlog's default logger (the worker's
// "moe-ep-worker", the coordinator's "moe-ep-coordinator"; format and level:
// core/logging.h):
//
//   warn   a call of a method under one of `warn_prefixes` that failed: once,
//          with the method, its code, the caller (gRPC's peer string, e.g.
//          "ipv4:127.0.0.1:41234"), the time it took and the message,
//            "/moe_ep.v1.Worker/Join from ipv4:127.0.0.1:41234 failed after
//             1.2 ms: FAILED_PRECONDITION: Join: this worker is leased ..."
//   info   a call of one of `info_methods` that succeeded (the calls that
//          change a worker's or a coordinator's state),
//            "/moe_ep.v1.Worker/Join from ipv4:127.0.0.1:41234: OK in 812.0 ms"
//   debug  every other call, in the same form ("... : NOT_FOUND in 0.1 ms"
//          for a failure outside `warn_prefixes`, e.g. a health Check of an
//          unknown name).
//
// The handlers' own lines say what a call did inside (e.g. "Join: forming
// gloo group generation 3 as rank 1 of 4"); this one says that it ended and
// how, for every call, so nothing fails silently.
//
// The line is written at PRE_SEND_STATUS, under gRPC's per-call locks (a
// health Watch ends inside its reactor's mutex): it takes spdlog's sink
// lock only, never a lock of this process (proto/rpc/health.h lock order).
//
// Thread-safe. Source: issue 31 item 5.

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/support/server_interceptor.h"

namespace moe_ep::rpc {

struct RpcLogOptions {
  // Full-method prefixes whose failures are warnings, e.g. "/moe_ep.v1.Worker/".
  std::vector<std::string> warn_prefixes;
  // Full method names whose successes are info, e.g. "/moe_ep.v1.Worker/Join".
  std::vector<std::string> info_methods;
};

// The worker's choice: failures of moe_ep.v1.Worker at warn (not those of
// the Rendezvous store, whose sliced waits time out by design, nor health
// or reflection); Join, Leave, ConfigureLayers, AllocateWorkspace,
// LoadExperts, InstallPlacement and Rejoin at info.
RpcLogOptions WorkerRpcLogOptions();

// For grpc::ServerBuilder::experimental().SetInterceptorCreators().
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeRpcLogInterceptorFactory(
    RpcLogOptions options);

}  // namespace moe_ep::rpc
