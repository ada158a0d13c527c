// A worker's NCCL communicator torn down while CUDA graphs that captured its
// work still exist (issue 30: moe_ep_worker_stop hung there, since NCCL's
// abort waits until such graphs are destroyed).
#include "kernels/nccl_graph_refs.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "kernels/nccl_collective.h"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace {

using testing::DeviceBuffer;
using Clock = std::chrono::steady_clock;

std::unique_ptr<NcclCollective> OneRank() {
  auto id = NcclCollective::NewUniqueId();
  EXPECT_TRUE(id.ok()) << id.status();
  auto c = NcclCollective::Create(*id, 0, 1, 0, std::chrono::seconds(20));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// Destroys `c` on another thread; true when that returned within `limit`.
// (A hung destructor leaves its thread behind: the test then fails.)
bool DestroyWithin(std::unique_ptr<NcclCollective> c, std::chrono::seconds limit) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> f = done->get_future();
  std::thread([c = std::move(c), done]() mutable {
    c.reset();
    done->set_value();
  }).detach();
  return f.wait_for(limit) == std::future_status::ready;
}

// Captures an all-to-all of `n` bytes to this rank itself (a send and a
// receive: a kernel plan, which NCCL's abort waits on) on c's stream into
// *graph, instantiates it as *exec and replays it once.
void CaptureAndReplay(NcclCollective& c, const DeviceBuffer<uint8_t>& send,
                      DeviceBuffer<uint8_t>& recv, int64_t n, cudaGraph_t* graph,
                      cudaGraphExec_t* exec) {
  const std::vector<int64_t> bytes = {n};
  ASSERT_EQ(cudaStreamBeginCapture(c.stream(), cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_TRUE(c.AllToAllV(send.get(), bytes, recv.get(), bytes).ok());
  ASSERT_EQ(cudaStreamEndCapture(c.stream(), graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(exec, *graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(*exec, c.stream()), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(c.stream()), cudaSuccess);
}

bool WaitUntil(const std::function<bool()>& cond, std::chrono::seconds limit) {
  const auto end = Clock::now() + limit;
  while (Clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

TEST(NcclGraphRefs, StreamNotCapturingCountsNothing) {
  MOE_EP_REQUIRE_GPUS(1);
  NcclGraphRefs refs;
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_TRUE(refs.NoteEnqueue(s).ok());
  EXPECT_EQ(refs.live(), 0);
  cudaStreamDestroy(s);
}

// One capture counts once however many calls it holds, a second capture
// again; a stream joined to another stream's capture (the engine's path:
// the caller's stream forks onto the collective's) counts that capture; the
// count falls only when the graph and its instance are both destroyed.
TEST(NcclGraphRefs, CountsEachCaptureUntilGraphAndInstanceAreGone) {
  MOE_EP_REQUIRE_GPUS(1);
  NcclGraphRefs refs;
  cudaStream_t caller = nullptr;
  cudaStream_t own = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), cudaSuccess);
  cudaGraph_t graphs[2] = {nullptr, nullptr};
  for (cudaGraph_t& graph : graphs) {
    ASSERT_EQ(cudaStreamBeginCapture(caller, cudaStreamCaptureModeGlobal), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(fork, caller), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(own, fork, 0), cudaSuccess);
    ASSERT_TRUE(refs.NoteEnqueue(own).ok());
    ASSERT_TRUE(refs.NoteEnqueue(own).ok());  // same capture: not counted again
    ASSERT_EQ(cudaEventRecord(join, own), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(caller, join, 0), cudaSuccess);
    ASSERT_EQ(cudaStreamEndCapture(caller, &graph), cudaSuccess);
  }
  EXPECT_EQ(refs.live(), 2);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graphs[0], 0), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graphs[0]), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graphs[1]), cudaSuccess);
  EXPECT_TRUE(WaitUntil([&] { return refs.live() == 1; }, std::chrono::seconds(10)));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(refs.live(), 1);  // the instance still holds graphs[0]'s
  ASSERT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_TRUE(WaitUntil([&] { return refs.live() == 0; }, std::chrono::seconds(10))) << refs.live();
  cudaEventDestroy(fork);
  cudaEventDestroy(join);
  cudaStreamDestroy(caller);
  cudaStreamDestroy(own);
}

// The hang of issue 30: a communicator whose all-to-all (a send and a
// receive to itself: a kernel plan NCCL's abort waits on) was captured and
// replayed is destroyed while the graph lives. Destruction returns; the
// abort stays pending while the graph lives and finishes once it is gone.
TEST(NcclGraphRefs, CommunicatorTornDownWhileItsGraphLivesDoesNotWait) {
  MOE_EP_REQUIRE_GPUS(1);
  const int before = NcclAbortsWaitingForGraphs();
  std::unique_ptr<NcclCollective> c = OneRank();
  ASSERT_NE(c, nullptr);
  DeviceBuffer<uint8_t> send(std::vector<uint8_t>{1, 2, 3, 4});
  DeviceBuffer<uint8_t> recv(4);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_NO_FATAL_FAILURE(CaptureAndReplay(*c, send, recv, 4, &graph, &exec));
  EXPECT_EQ(recv.Download(4), (std::vector<uint8_t>{1, 2, 3, 4}));

  ASSERT_TRUE(DestroyWithin(std::move(c), std::chrono::seconds(20)));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(NcclAbortsWaitingForGraphs(), before + 1);  // pending: the graph lives
  ASSERT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_TRUE(
      WaitUntil([&] { return NcclAbortsWaitingForGraphs() == before; }, std::chrono::seconds(20)))
      << NcclAbortsWaitingForGraphs();
}

// Graphs destroyed just before the teardown (their release is asynchronous)
// and no capture at all: the communicator is aborted on the caller's thread.
TEST(NcclGraphRefs, CommunicatorWhoseGraphsAreGoneAbortsInline) {
  MOE_EP_REQUIRE_GPUS(1);
  const int before = NcclAbortsWaitingForGraphs();
  std::unique_ptr<NcclCollective> c = OneRank();
  ASSERT_NE(c, nullptr);
  DeviceBuffer<uint8_t> send(std::vector<uint8_t>{7});
  DeviceBuffer<uint8_t> recv(1);
  const std::vector<int64_t> bytes = {1};
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_NO_FATAL_FAILURE(CaptureAndReplay(*c, send, recv, 1, &graph, &exec));
  ASSERT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  ASSERT_TRUE(DestroyWithin(std::move(c), std::chrono::seconds(20)));
  EXPECT_EQ(NcclAbortsWaitingForGraphs(), before);

  std::unique_ptr<NcclCollective> plain = OneRank();
  ASSERT_NE(plain, nullptr);
  ASSERT_TRUE(plain->AllToAllV(send.get(), bytes, recv.get(), bytes).ok());
  ASSERT_TRUE(plain->Synchronize().ok());
  ASSERT_TRUE(DestroyWithin(std::move(plain), std::chrono::seconds(20)));
  EXPECT_EQ(NcclAbortsWaitingForGraphs(), before);
}

}  // namespace
}  // namespace moe_ep::kernels
