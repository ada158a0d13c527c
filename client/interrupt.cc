#include "client/interrupt.h"

#include <pthread.h>
#include <signal.h>

#include <cstring>
#include <thread>

#include "absl/synchronization/mutex.h"

namespace moe_ep::client {
namespace {

absl::Mutex g_mu;
bool g_installed = false;
int g_signal = 0;

}  // namespace

absl::Status InstallInterruptHandler(std::function<void(int signo)> on_signal) {
  {
    absl::MutexLock lock(&g_mu);
    if (g_installed) return absl::FailedPreconditionError("interrupt handler already installed");
    g_installed = true;
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  const int rc = pthread_sigmask(SIG_BLOCK, &set, nullptr);
  if (rc != 0) {
    return absl::InternalError(std::string("pthread_sigmask: ") + strerror(rc));
  }
  // Blocked first, so the default action can never run in between.
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  std::thread([set, on_signal = std::move(on_signal)] {
    int signo = 0;
    while (sigwait(&set, &signo) != 0) {
    }
    {
      absl::MutexLock lock(&g_mu);
      g_signal = signo;
    }
    if (on_signal) on_signal(signo);
  }).detach();
  return absl::OkStatus();
}

int WaitForInterrupt() {
  absl::MutexLock lock(&g_mu);
  g_mu.Await(absl::Condition(
      +[](int* s) { return *s != 0; }, &g_signal));
  return g_signal;
}

int InterruptSignal() {
  absl::MutexLock lock(&g_mu);
  return g_signal;
}

}  // namespace moe_ep::client
