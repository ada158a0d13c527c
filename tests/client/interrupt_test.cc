#include "client/interrupt.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <thread>

#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

// A thread that existed before the handler (as a BLAS library's pool does
// before main()) gets SIGTERM: the process is not killed, the handler's
// thread sees the signal and calls back (issue 31 item 2: the coordinator
// must live to give its lease back). In a child process (a death test), so
// this binary's own handling of signals is left alone.
TEST(InstallInterruptHandler, ASignalToAThreadStartedBeforeItIsSeenNotFatal) {
  EXPECT_EXIT(
      {
        std::atomic<bool> stop{false};
        std::thread early([&] {
          while (!stop) std::this_thread::yield();
        });
        std::atomic<int> called{0};
        if (!InstallInterruptHandler([&](int signo) { called = signo; }).ok()) std::_Exit(3);
        if (InstallInterruptHandler(nullptr).code() != absl::StatusCode::kFailedPrecondition) {
          std::_Exit(4);
        }
        // Delivered to that thread on purpose: the handler, not the default
        // action, must run there.
        pthread_kill(early.native_handle(), SIGTERM);  // NOLINT(bugprone-bad-signal-to-kill-thread)
        const int seen = WaitForInterrupt();
        while (called == 0) std::this_thread::yield();
        stop = true;
        early.join();
        std::_Exit(seen == SIGTERM && called == SIGTERM && InterruptSignal() == SIGTERM ? 0 : 5);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace moe_ep::client
