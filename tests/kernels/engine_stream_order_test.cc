#include "kernels/engine_stream_order.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

#include "gtest/gtest.h"
#include "kernels/device_calls.h"

namespace moe_ep::kernels {
namespace {

// A host function that holds its stream until Open(): work enqueued after
// it on that stream (or ordered after it) cannot have run while it holds.
class Gate {
 public:
  void Enqueue(cudaStream_t stream) {
    ASSERT_EQ(cudaLaunchHostFunc(stream, &Gate::Hold, this), cudaSuccess);
  }
  void Open() { open_.store(true); }

 private:
  static void Hold(void* self) {
    while (!static_cast<Gate*>(self)->open_.load()) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  std::atomic<bool> open_{false};
};

// A device int32, its pinned host copy and three streams; the gate opens
// in teardown so that a failed expectation never leaves a stream held.
class EngineStreamOrderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (VisibleDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA device";
    ASSERT_TRUE(SetDevice(0).ok());
    for (cudaStream_t* s : {&own_, &a_, &b_}) {
      ASSERT_EQ(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking), cudaSuccess);
    }
    ASSERT_EQ(cudaMalloc(&value_, sizeof(int32_t)), cudaSuccess);
    ASSERT_EQ(cudaMemset(value_, 0, sizeof(int32_t)), cudaSuccess);
    absl::StatusOr<PinnedHostMemory> pinned = AllocatePinned(sizeof(int32_t), "seen");
    ASSERT_TRUE(pinned.ok()) << pinned.status();
    host_ = std::move(*pinned);
    *Seen() = -1;
    absl::StatusOr<std::unique_ptr<EngineStreamOrder>> order = EngineStreamOrder::Create(own_);
    ASSERT_TRUE(order.ok()) << order.status();
    order_ = std::move(*order);
  }
  void TearDown() override {
    gate_.Open();
    if (own_ == nullptr) return;
    cudaDeviceSynchronize();
    order_.reset();
    cudaFree(value_);
    for (cudaStream_t s : {own_, a_, b_}) cudaStreamDestroy(s);
  }
  int32_t* Seen() { return static_cast<int32_t*>(host_.get()); }
  // Sets the value's bytes to `byte` on `s`, or copies it to Seen() on `s`.
  void Write(cudaStream_t s, int byte) {
    ASSERT_EQ(cudaMemsetAsync(value_, byte, sizeof(int32_t), s), cudaSuccess);
  }
  void Read(cudaStream_t s) {
    ASSERT_EQ(cudaMemcpyAsync(Seen(), value_, sizeof(int32_t), cudaMemcpyDeviceToHost, s),
              cudaSuccess);
  }
  // Whether `s` still has work pending after a pause long enough for an
  // unordered copy to finish.
  static bool StillPending(cudaStream_t s) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return cudaStreamQuery(s) == cudaErrorNotReady;
  }
  static int32_t Bytes(int byte) { return byte * 0x01010101; }

  cudaStream_t own_ = nullptr;
  cudaStream_t a_ = nullptr;
  cudaStream_t b_ = nullptr;
  int32_t* value_ = nullptr;
  PinnedHostMemory host_;
  std::unique_ptr<EngineStreamOrder> order_;
  Gate gate_;
};

// The engine's stream waits for what the own stream held: the call's read
// sees the own stream's write, made after the gate opened.
TEST_F(EngineStreamOrderTest, ACallFollowsTheOwnStreamsWork) {
  gate_.Enqueue(own_);
  Write(own_, 1);
  absl::StatusOr<cudaStream_t> on = order_->Begin(a_);
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(*on, a_);
  EXPECT_EQ(order_->launch(), a_);
  Read(*on);
  ASSERT_TRUE(order_->End().ok());
  EXPECT_EQ(order_->launch(), own_);
  EXPECT_TRUE(StillPending(a_));
  gate_.Open();
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(*Seen(), Bytes(1));
}

// After Settle the own stream waits for the last call on the engine's
// stream; without a call in between, Settle waits for nothing.
TEST_F(EngineStreamOrderTest, SettleOrdersTheOwnStreamAfterTheLastCall) {
  ASSERT_TRUE(order_->Settle().ok());
  ASSERT_TRUE(order_->Begin(a_).ok());
  gate_.Enqueue(a_);
  Write(a_, 2);
  ASSERT_TRUE(order_->End().ok());
  ASSERT_TRUE(order_->Settle().ok());
  Read(own_);
  EXPECT_TRUE(StillPending(own_));
  gate_.Open();
  ASSERT_EQ(cudaStreamSynchronize(own_), cudaSuccess);
  EXPECT_EQ(*Seen(), Bytes(2));
}

// A call on another engine stream waits for the call before it, and a
// second call on the same stream keeps the order of the stream itself.
TEST_F(EngineStreamOrderTest, AnotherEngineStreamFollowsTheLastCall) {
  ASSERT_TRUE(order_->Begin(a_).ok());
  gate_.Enqueue(a_);
  Write(a_, 3);
  ASSERT_TRUE(order_->End().ok());
  ASSERT_TRUE(order_->Begin(a_).ok());
  Write(a_, 4);
  ASSERT_TRUE(order_->End().ok());
  absl::StatusOr<cudaStream_t> on = order_->Begin(b_);
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(*on, b_);
  Read(b_);
  ASSERT_TRUE(order_->End().ok());
  EXPECT_TRUE(StillPending(b_));
  gate_.Open();
  ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
  EXPECT_EQ(*Seen(), Bytes(4));
}

// Own work between two calls on one engine stream: the second call forks
// from the own stream again (the same stream is not enough).
TEST_F(EngineStreamOrderTest, OwnWorkBetweenCallsOnOneStreamIsWaitedFor) {
  ASSERT_TRUE(order_->Begin(a_).ok());
  Write(a_, 5);
  ASSERT_TRUE(order_->End().ok());
  ASSERT_TRUE(order_->Settle().ok());
  gate_.Enqueue(own_);
  Write(own_, 6);
  ASSERT_TRUE(order_->Begin(a_).ok());
  Read(a_);
  ASSERT_TRUE(order_->End().ok());
  EXPECT_TRUE(StillPending(a_));
  gate_.Open();
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(*Seen(), Bytes(6));
}

// The own stream as the caller's runs there; a second Begin while a call
// is open is refused and leaves the open call as it was.
TEST_F(EngineStreamOrderTest, OwnCallerAndNestedBegin) {
  absl::StatusOr<cudaStream_t> on = order_->Begin(own_);
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(*on, own_);
  ASSERT_TRUE(order_->End().ok());
  ASSERT_TRUE(order_->Begin(a_).ok());
  const absl::StatusOr<cudaStream_t> nested = order_->Begin(b_);
  EXPECT_EQ(nested.status().code(), absl::StatusCode::kFailedPrecondition) << nested.status();
  EXPECT_EQ(order_->launch(), a_);
  ASSERT_TRUE(order_->End().ok());
  EXPECT_TRUE(order_->End().ok());  // nothing open: no-op
}

// A default stream (here the legacy one, NULL) forks onto the own stream:
// the call's work goes there, after the default stream's, and End joins it
// back.
TEST_F(EngineStreamOrderTest, ADefaultStreamForksOntoTheOwnStream) {
  gate_.Enqueue(nullptr);
  Write(nullptr, 9);
  absl::StatusOr<cudaStream_t> on = order_->Begin(nullptr);
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(*on, own_);
  EXPECT_EQ(order_->launch(), own_);
  Read(*on);
  ASSERT_TRUE(order_->End().ok());
  EXPECT_TRUE(StillPending(own_));
  gate_.Open();
  ASSERT_EQ(cudaStreamSynchronize(own_), cudaSuccess);
  EXPECT_EQ(*Seen(), Bytes(9));
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
}

// Inside a capture of the engine's stream nothing is recorded or waited
// for: the capture ends cleanly (no stream left joined to it), the graph
// holds the call's work, and Settle afterwards does not touch the graph.
TEST_F(EngineStreamOrderTest, ACapturedCallRecordsNothing) {
  ASSERT_TRUE(order_->Begin(a_).ok());  // an eager call first: a_ is the tail
  Write(a_, 7);
  ASSERT_TRUE(order_->End().ok());
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(a_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  absl::StatusOr<cudaStream_t> on = order_->Begin(a_);
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(*on, a_);
  Write(a_, 8);
  const absl::Status ended = order_->End();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(a_, &graph), cudaSuccess);
  ASSERT_TRUE(ended.ok()) << ended;
  ASSERT_TRUE(order_->Settle().ok());
  ASSERT_EQ(cudaStreamSynchronize(own_), cudaSuccess);
  Read(own_);
  ASSERT_EQ(cudaStreamSynchronize(own_), cudaSuccess);
  EXPECT_EQ(*Seen(), Bytes(7));  // captured, not run
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, a_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  Read(a_);
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(*Seen(), Bytes(8));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

}  // namespace
}  // namespace moe_ep::kernels
