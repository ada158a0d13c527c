#pragma once

// SIGINT / SIGTERM handling for the CLI. Installing blocks both signals in the
// calling thread — call it first thing in main(), before any thread exists, so
// every later thread inherits the mask — and starts one thread that waits for
// them with sigwait(). On a signal that thread calls `on_signal(signo)` in
// normal (not async-signal) context, so the callback may take locks, stop the
// local cluster (LocalCluster::StopAll) and print.
//
// Both signals get their default disposition first: a shell starts background
// jobs with SIGINT ignored, and an ignored signal is discarded even while
// blocked, so `kill -INT` would never reach the waiting thread.
//
// Worker processes started afterwards must unblock the signals themselves
// (client/local_cluster.cc does so before exec).
// Source: issue 2 ("stops them all on exit or Ctrl-C").

#include <functional>

#include "absl/status/status.h"

namespace moe_ep::client {

// Errors: kFailedPrecondition when called twice; kInternal when the mask
// cannot be set.
absl::Status InstallInterruptHandler(std::function<void(int signo)> on_signal);

// Blocks until InstallInterruptHandler's thread has seen a signal; returns it.
int WaitForInterrupt();

// The signal seen so far, or 0.
int InterruptSignal();

}  // namespace moe_ep::client
