#include "client/interrupt.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/synchronization/mutex.h"

namespace moe_ep::client {
namespace {

absl::Mutex g_mu;
bool g_installed = false;
int g_signal = 0;
int g_pipe[2] = {-1, -1};

// Any thread may run it (threads that exist before main(), e.g. a BLAS
// library's pool, never inherit a mask): write() is async-signal-safe; a
// full pipe only drops a repeated signal.
void OnSignal(int signo) {
  const int saved_errno = errno;
  const ssize_t ignored = write(g_pipe[1], &signo, sizeof(signo));
  (void)ignored;
  errno = saved_errno;
}

}  // namespace

absl::Status InstallInterruptHandler(std::function<void(int signo)> on_signal) {
  {
    absl::MutexLock lock(&g_mu);
    if (g_installed) return absl::FailedPreconditionError("interrupt handler already installed");
    g_installed = true;
  }
  if (pipe2(g_pipe, O_CLOEXEC) != 0) {
    return absl::InternalError(std::string("pipe2: ") + strerror(errno));
  }
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  for (int signo : {SIGINT, SIGTERM}) {
    if (sigaction(signo, &action, nullptr) != 0) {
      return absl::InternalError(std::string("sigaction: ") + strerror(errno));
    }
  }
  std::thread([on_signal = std::move(on_signal)] {
    int signo = 0;
    while (read(g_pipe[0], &signo, sizeof(signo)) != static_cast<ssize_t>(sizeof(signo))) {
      if (errno != EINTR) return;
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
