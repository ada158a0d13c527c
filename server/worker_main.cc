// moe_ep_worker_main (server/moe_ep.h): the whole moe-ep-worker process, so
// that the executable (server/main.cc) is this library plus main(). The
// services, servers and flags are server/worker_process.h; this file adds
// what only a process does: stop signals, the "listening on" line and the
// exit when a call outlives the drain.
//
// After binding it prints exactly one line to stdout,
//   moe-ep-worker listening on HOST:PORT
// (the local cluster launcher parses it). SIGTERM / SIGINT: health goes
// NOT_SERVING, new calls get UNAVAILABLE, in-flight calls may finish until
// --drain-timeout-ms (then they are cancelled; one stuck in a collective
// gets 0.5 s more, then the process exits anyway, which drops the
// communicator so that its peers fail instead of hanging); exit 0. An idle
// worker exits at once.

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/moe_ep.h"
#include "server/worker_flags.h"
#include "server/worker_process.h"
#include "spdlog/spdlog.h"

namespace {

// After the drain deadline, how long a call stuck in a collective may hold
// the process before it exits anyway.
constexpr absl::Duration kExitGrace = absl::Milliseconds(500);

int g_signal_pipe[2] = {-1, -1};

void OnStopSignal(int signal_number) {
  // write() is async-signal-safe; a full pipe only drops a repeated signal.
  const ssize_t ignored = write(g_signal_pipe[1], &signal_number, sizeof(signal_number));
  (void)ignored;
}

int Fail(const std::string& message) {
  spdlog::error("{}", message);
  std::cerr << "moe-ep-worker: " << message << std::endl;
  return 2;
}

}  // namespace

extern "C" int moe_ep_worker_main(int argc, char** argv) {
  moe_ep::server::WorkerFlags flags;
  if (std::optional<int> exit_code =
          moe_ep::server::ParseWorkerFlags(argc, argv, &flags, std::cout, std::cerr)) {
    return *exit_code;
  }
  // Stop signals: a handler (run on whichever thread gets the signal) writes
  // the signal number into a pipe that this thread reads after start-up.
  if (pipe(g_signal_pipe) != 0) return Fail("cannot create the signal pipe");
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);

  auto started = moe_ep::server::WorkerProcess::Start(flags);
  if (!started.ok()) return Fail(std::string(started.status().message()));
  std::unique_ptr<moe_ep::server::WorkerProcess> process = std::move(*started);
  std::cout << "moe-ep-worker listening on " << process->address() << std::endl;

  int signal_number = 0;
  while (read(g_signal_pipe[0], &signal_number, sizeof(signal_number)) < 0 && errno == EINTR) {
  }
  const absl::Time drain_deadline = absl::Now() + absl::Milliseconds(flags.drain_timeout_ms);
  spdlog::info("signal {}: NOT_SERVING, draining {} in-flight call(s) for up to {} ms",
               signal_number, process->in_flight(), flags.drain_timeout_ms);
  // A handler stuck in a collective returns only at the group's timeout; do
  // not let it hold the process past the drain deadline plus a short grace.
  // Exiting closes the data plane's sockets (Gloo) or ends the process that
  // holds the communicator (NCCL), so the peers fail with UNAVAILABLE /
  // DEADLINE_EXCEEDED instead of waiting on this rank.
  std::thread([drain_deadline] {
    absl::SleepFor(drain_deadline + kExitGrace - absl::Now());
    spdlog::warn("a call is still stuck {} after the drain deadline; exiting",
                 absl::FormatDuration(kExitGrace));
    std::fflush(stdout);
    std::_Exit(0);
  }).detach();
  process->Shutdown(drain_deadline);
  spdlog::info("stopped");
  return 0;
}
