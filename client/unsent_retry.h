#pragma once

// One retry for a worker call that gRPC failed before sending it.
//
// Debian's gRPC 1.51 can fail a fresh channel's first connect spuriously under
// load (the connect's errno is overwritten before it is read: "No such file or
// directory"; fixed upstream in grpc/grpc#35064). A fail-fast call picked onto
// that channel fails UNAVAILABLE at once and never reaches the worker, while
// its peers, which did get theirs, wait out the collective's deadline. The
// call was never sent, so sending it again once the channel connects cannot
// run it twice. A refused connection (nothing listens: the worker is down) is
// not retried, so a dead rank is still reported at once.

#include <chrono>
#include <functional>

#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/status.h"

namespace moe_ep::client {

// True when `status` is gRPC's failure of a fail-fast call for want of a
// connection (UNAVAILABLE whose message begins "failed to connect to all
// addresses"): the call never left this client. False for every other
// status, including a failure after the call was sent (a reset or closed
// socket, a deadline) and a worker's own UNAVAILABLE, even one quoting that
// text about a connection of its own.
bool FailedBeforeSending(const grpc::Status& status);

// FailedBeforeSending(status), except a refused connection ("Connection
// refused": nothing listens at the address).
bool FailedBeforeSendingTransiently(const grpc::Status& status);

// Runs `call` with a fresh ClientContext whose deadline is `deadline`. When it
// fails with FailedBeforeSendingTransiently, waits for `channel` to connect
// (at most `connect_grace`, never past `deadline`) and, once connected, runs
// `call` once more with a fresh context; otherwise, or when the channel does
// not connect in time (or with under 5 ms left), returns the first status. `call` must not change
// the context's deadline. Blocks up to `deadline`. Thread-safe when `call` is.
grpc::Status CallRetryingUnsent(grpc::Channel& channel,
                                std::chrono::system_clock::time_point deadline,
                                absl::Duration connect_grace,
                                const std::function<grpc::Status(grpc::ClientContext*)>& call);

// The connect grace for a channel whose reconnect back-off is
// `reconnect_backoff` (zero = gRPC's default, 1 s with 20% jitter): one
// back-off with its jitter plus 1 s for the connect itself.
absl::Duration ConnectGrace(absl::Duration reconnect_backoff);

}  // namespace moe_ep::client
