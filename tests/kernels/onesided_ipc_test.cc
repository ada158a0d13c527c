#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/gloo_collective.h"
#include "gloo/rendezvous/file_store.h"
#include "kernels/onesided/onesided_dispatcher.h"
#include "kernels/onesided/peer_window.h"
#include "tests/kernels/onesided_test_util.h"

// The one-sided data plane across 2 and 4 worker processes sharing one GPU through
// CUDA IPC (provider CreateIpcPeerWindows, handles all-gathered over a Gloo
// group on loopback with a file rendezvous store). OneSidedIpc.TwoProcesses
// (FourProcesses) spawns this binary 2 (4) times running
// OneSidedIpcWorker.Run as ranks 0..N-1
// (fresh processes: no CUDA context is inherited through fork) and passes
// when all pass. Processes time-slice the GPU: this proves correctness of
// the protocol between processes, not speed.

extern char** environ;

namespace moe_ep::kernels::onesided {
namespace {

using core::bf16_t;
using testing::OsCase;
using testing::Prepare;
using testing::Prepared;
using testing::RankBuffers;

constexpr char kRankEnv[] = "MOE_EP_ONESIDED_IPC_RANK";
constexpr char kStoreEnv[] = "MOE_EP_ONESIDED_IPC_STORE";
constexpr char kSizeEnv[] = "MOE_EP_ONESIDED_IPC_SIZE";

// The first `size` entries of a per-rank list.
std::vector<int64_t> First(int size, std::vector<int64_t> v) {
  v.resize(size);
  return v;
}

TEST(OneSidedIpcWorker, Run) {
  const char* rank_env = std::getenv(kRankEnv);
  const char* store_env = std::getenv(kStoreEnv);
  const char* size_env = std::getenv(kSizeEnv);
  if (rank_env == nullptr || store_env == nullptr || size_env == nullptr) {
    std::printf("[  SKIPPED ] a worker of OneSidedIpc.*Processes, which spawn it\n");
    GTEST_SKIP() << "run by OneSidedIpc.TwoProcesses and FourProcesses";
  }
  const int rank = std::atoi(rank_env);
  const int size = std::atoi(size_env);
  auto store = std::make_shared<gloo::rendezvous::FileStore>(store_env);
  auto ctrl =
      core::GlooCollective::Create(store, "onesided", rank, size, "127.0.0.1", absl::Seconds(60));
  ASSERT_TRUE(ctrl.ok()) << ctrl.status();
  const int64_t capacity = 64;
  const OsCase base{size, 1024, 8, 64, First(size, {40, 7, 0, 19})};
  auto bytes = OneSidedDispatcher::WindowBytes(testing::EpOptions(base, capacity));
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto windows = CreateIpcPeerWindows(ctrl->get(), 0, *bytes);
  ASSERT_TRUE(windows.ok()) << windows.status();
  EXPECT_STREQ((*windows)->provider(), "cuda-ipc");
  {
    auto d = OneSidedDispatcher::Create(windows->get(),
                                        testing::Options(base, capacity, absl::Seconds(30)), 0);
    ASSERT_TRUE(d.ok()) << d.status();
    // 1. Uneven tokens, then a zero-token rank with invalid ids, eager.
    for (const OsCase& c : {OsCase{size, 1024, 8, 64, First(size, {40, 7, 0, 19})},
                            OsCase{size, 1024, 8, 64, First(size, {0, 33, 64, 1}), 64, 0.3}}) {
      OsCase cc = c;
      cc.r = capacity;
      const Prepared p = Prepare(cc);
      auto experts = DeviceExpertSet::Upload(p.sets[rank]);
      ASSERT_TRUE(experts.ok());
      auto d2 = OneSidedDispatcher::Create(windows->get(),
                                           testing::Options(cc, capacity, absl::Seconds(30)), 0);
      ASSERT_TRUE(d2.ok()) << d2.status();
      RankBuffers b(p, rank, cc.tokens[rank]);
      ASSERT_TRUE((*ctrl)->Barrier().ok());
      testing::RunCheckedStep(p, rank, **d2, **experts, b, 3, false);
      ASSERT_TRUE((*ctrl)->Barrier().ok());
    }
    // 2. Epoch mismatch: both report it, neither writes output.
    const Prepared p =
        Prepare(OsCase{size, 1024, 8, 64, First(size, {40, 7, 0, 19}), -1, 0.1, 0, capacity});
    auto experts = DeviceExpertSet::Upload(p.sets[rank]);
    ASSERT_TRUE(experts.ok());
    {
      const int64_t t = p.c.tokens[rank];
      RankBuffers b(p, rank, t);
      b.PoisonOutput(t, p.c.hidden);
      ASSERT_TRUE((*d)->CommitGeometry(rank == 0 ? 8 : 9, capacity, t).ok());
      ASSERT_TRUE(
          (*d)->Forward(b.hidden.get(), b.ids.get(), b.weights.get(), t, **experts, b.out.get())
              .ok());
      absl::Status s = (*d)->CheckStep();
      EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
      // Rank 0 sees rank 1 first; every other rank sees rank 0.
      EXPECT_NE(s.message().find(
                    absl::StrFormat("rank %d has (epoch %d", rank == 0 ? 1 : 0, rank == 0 ? 9 : 8)),
                std::string::npos)
          << s;
      for (bf16_t v : b.out.Download(t * p.c.hidden)) ASSERT_EQ(v, 0xffff);
    }
    // 3. Agreed again: correct.
    {
      RankBuffers b(p, rank, p.c.tokens[rank]);
      testing::RunCheckedStep(p, rank, **d, **experts, b, 10, false);
    }
    // 4. Graph at bucket 64 replayed below it.
    {
      RankBuffers b(p, rank, capacity);
      ASSERT_TRUE((*d)->CommitGeometry(11, capacity, capacity).ok());
      ASSERT_TRUE((*d)->CaptureForward(capacity, b.hidden.get(), b.ids.get(), b.weights.get(),
                                       **experts, b.out.get())
                      .ok());
      const Prepared q =
          Prepare(OsCase{size, 1024, 8, 64, First(size, {5, 0, 64, 3}), -1, 0.1, 0, capacity, 91});
      b.Load(q, rank);
      ASSERT_TRUE((*d)->ReplayForward(capacity, 12, q.c.tokens[rank]).ok());
      absl::Status s = (*d)->CheckStep();
      ASSERT_TRUE(s.ok()) << s;
      testing::ExpectReceived(q, rank, **d);
      const auto all = b.out.Download(capacity * q.c.hidden);
      testing::ExpectOutput(
          q, rank, std::vector<bf16_t>(all.begin(), all.begin() + q.c.tokens[rank] * q.c.hidden));
    }
    ASSERT_TRUE((*ctrl)->Barrier().ok());
  }
  // 5. The last rank is late (takes no part): every other rank gets
  // DEADLINE_EXCEEDED naming it.
  {
    const Prepared p =
        Prepare(OsCase{size, 1024, 8, 64, First(size, {40, 7, 0, 19}), -1, 0.1, 0, capacity});
    auto d = OneSidedDispatcher::Create(
        windows->get(), testing::Options(p.c, capacity, absl::Milliseconds(500)), 0);
    ASSERT_TRUE(d.ok()) << d.status();
    const int late = size - 1;
    auto experts = DeviceExpertSet::Upload(p.sets[rank]);
    ASSERT_TRUE(experts.ok());
    const int64_t t = p.c.tokens[rank];
    RankBuffers b(p, rank, t);
    ASSERT_TRUE((*ctrl)->Barrier().ok());  // the punctual ranks start together
    if (rank != late) {
      ASSERT_TRUE((*d)->CommitGeometry(1, capacity, t).ok());
      ASSERT_TRUE(
          (*d)->Forward(b.hidden.get(), b.ids.get(), b.weights.get(), t, **experts, b.out.get())
              .ok());
      absl::Status s = (*d)->CheckStep();
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_NE(s.message().find(absl::StrFormat("for rank %d's flag", late)), std::string::npos)
          << s;
    }
    ASSERT_TRUE((*ctrl)->Barrier().ok());
  }
}

void RunProcesses(int size) {
  MOE_EP_REQUIRE_GPUS(1);
  char dir[] = "/tmp/moe_ep_onesided_ipc_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) env_strings.push_back(*e);
    env_strings.push_back(std::string(kRankEnv) + "=" + std::to_string(r));
    env_strings.push_back(std::string(kStoreEnv) + "=" + dir);
    env_strings.push_back(std::string(kSizeEnv) + "=" + std::to_string(size));
    std::vector<char*> envp;
    envp.reserve(env_strings.size() + 1);
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe";
    std::string filter = "--gtest_filter=OneSidedIpcWorker.Run";
    char* argv[] = {exe.data(), filter.data(), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()), 0);
    pids.push_back(pid);
  }
  // Every wait in the workers is bounded (Gloo 60 s, flags 30 s); 300 s
  // bounds the whole run so a broken worker fails the test, never hangs it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  for (size_t r = 0; r < pids.size(); ++r) {
    int status = 0;
    pid_t got = 0;
    while ((got = waitpid(pids[r], &status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (got == 0) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], &status, 0);
      ADD_FAILURE() << "worker rank " << r << " did not finish within 300 s";
      continue;
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "worker rank " << r << " failed (status " << status << "); its output is above";
  }
  std::string cleanup = std::string("rm -rf ") + dir;
  EXPECT_EQ(std::system(cleanup.c_str()), 0);
}

TEST(OneSidedIpc, TwoProcesses) { RunProcesses(2); }
TEST(OneSidedIpc, FourProcesses) { RunProcesses(4); }

}  // namespace
}  // namespace moe_ep::kernels::onesided
