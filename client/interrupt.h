#pragma once

// SIGINT / SIGTERM handling for the CLI. Installing sets a handler for both
// signals that writes the signal's number into a pipe (whichever thread the
// kernel picks runs it: a mask would not cover threads that exist before
// main(), such as a BLAS library's pool, and a signal landing there killed
// the process without its clean-up, e.g. the coordinator's lease release;
// issue 31 item 2), and starts one thread that reads the pipe. On a signal
// that thread calls `on_signal(signo)` in normal (not async-signal) context,
// so the callback may take locks, stop the local cluster
// (LocalCluster::StopAll) and print. Later signals are ignored.
//
// The handler also replaces an ignored disposition: a shell starts
// background jobs with SIGINT ignored, and `kill -INT` must still stop them.
// Worker processes started afterwards get the default dispositions back at
// exec (client/local_cluster.cc also unblocks the signals there).
// Source: issue 2 ("stops them all on exit or Ctrl-C").

#include <functional>

#include "absl/status/status.h"

namespace moe_ep::client {

// Errors: kFailedPrecondition when called twice; kInternal when the pipe or
// a handler cannot be set up.
absl::Status InstallInterruptHandler(std::function<void(int signo)> on_signal);

// Blocks until InstallInterruptHandler's thread has seen a signal; returns it.
int WaitForInterrupt();

// The signal seen so far, or 0.
int InterruptSignal();

}  // namespace moe_ep::client
