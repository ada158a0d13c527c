#include "kernels/device_calls.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::kernels {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// With or without a GPU: a device past the visible ones is an error that
// names the call and the device, and a bus id no device has is unreachable.
TEST(DeviceCalls, ADeviceBeyondTheVisibleOnesIsNamed) {
  const int count = VisibleDeviceCount();
  EXPECT_GE(count, 0);
  const absl::Status set = SetDevice(count);
  EXPECT_EQ(set.code(), absl::StatusCode::kInternal) << set;
  EXPECT_THAT(std::string(set.message()),
              StartsWith("cudaSetDevice(" + std::to_string(count) + "): "));
  const absl::StatusOr<DeviceProperties> props = QueryDevice(count);
  EXPECT_EQ(props.status().code(), absl::StatusCode::kUnavailable) << props.status();
  EXPECT_THAT(std::string(props.status().message()),
              StartsWith("cudaGetDeviceProperties(device " + std::to_string(count) + "): "));
  EXPECT_FALSE(CanReachPeer(0, "not a bus id"));
  // The failed lookups left no error for a later launch check (without a
  // driver the runtime's own "insufficient driver" stays: sticky).
  if (count > 0) {
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

// On a GPU: bytes go to the device and back unchanged through both async
// copies and the synchronous one, pinned memory holds them, zero bytes copy
// nothing (null pointers allowed), a capture of the stream is seen, and a
// device reaches its own bus id's device.
TEST(DeviceCalls, CopiesRoundTripAndACaptureIsSeen) {
  if (VisibleDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA device";
  ASSERT_TRUE(SetDevice(0).ok());
  const absl::StatusOr<DeviceProperties> props = QueryDevice(0);
  ASSERT_TRUE(props.ok()) << props.status();
  EXPECT_FALSE(props->name.empty());
  EXPECT_GT(props->total_memory_bytes, int64_t{1} << 30);

  constexpr int kN = 1000;
  std::vector<int32_t> in(kN);
  for (int i = 0; i < kN; ++i) in[i] = i * 7919 - 3;
  absl::StatusOr<PinnedHostMemory> pinned = AllocatePinned(kN * 4, "round trip");
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  auto* back = static_cast<int32_t*>(pinned->get());
  int32_t* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, kN * 4), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  EXPECT_TRUE(CopyToDeviceAsync(device, in.data(), kN * 4, stream, "in").ok());
  EXPECT_TRUE(CopyToHostAsync(back, device, kN * 4, stream, "back").ok());
  EXPECT_TRUE(CopyToHostAsync(nullptr, nullptr, 0, stream, "nothing").ok());
  EXPECT_TRUE(SynchronizeStream(stream, "test stream").ok());
  EXPECT_EQ(std::vector<int32_t>(back, back + kN), in);
  std::vector<int32_t> again(kN, 0);
  EXPECT_TRUE(CopyToHost(again.data(), device, kN * 4, "again").ok());
  EXPECT_EQ(again, in);

  absl::StatusOr<bool> capturing = StreamIsCapturing(stream);
  ASSERT_TRUE(capturing.ok()) << capturing.status();
  EXPECT_FALSE(*capturing);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  capturing = StreamIsCapturing(stream);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(capturing.ok()) << capturing.status();
  EXPECT_TRUE(*capturing);
  cudaGraphDestroy(graph);

  const absl::StatusOr<std::string> bus = PciBusId(0);
  ASSERT_TRUE(bus.ok()) << bus.status();
  EXPECT_THAT(*bus, HasSubstr(":"));
  cudaStreamDestroy(stream);
  cudaFree(device);
}

// Host memory and nullptr are never device memory, remembered or not; a
// device address is found once and then remembered, and the memory's cap
// starts it again rather than growing.
TEST(DevicePointerCache, RemembersDeviceAddressesOnly) {
  DevicePointerCache cache;
  std::vector<int32_t> host(16, 0);
  EXPECT_FALSE(cache.IsDevicePointer(nullptr));
  EXPECT_FALSE(cache.IsDevicePointer(host.data()));
  EXPECT_FALSE(cache.IsDevicePointer(host.data()));
  if (VisibleDeviceCount() < 1) GTEST_SKIP() << "device addresses need a CUDA device";
  ASSERT_TRUE(SetDevice(0).ok());
  int32_t* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 64 * 4), cudaSuccess);
  EXPECT_TRUE(cache.IsDevicePointer(device));
  EXPECT_TRUE(cache.IsDevicePointer(device));
  EXPECT_TRUE(cache.IsDevicePointer(device + 5));  // inside the allocation
  EXPECT_FALSE(cache.IsDevicePointer(host.data()));
  // The remembered ordinal: device 0's memory is not device 1's (the engine
  // passed another device's tensor), remembered or looked up.
  EXPECT_TRUE(cache.IsDevicePointer(device, 0));
  EXPECT_FALSE(cache.IsDevicePointer(device, 1));
  EXPECT_FALSE(cache.IsDevicePointer(device + 7, 1));
  EXPECT_TRUE(cache.IsDevicePointer(device + 7, 0));
  EXPECT_FALSE(cache.IsDevicePointer(host.data(), 0));
  for (size_t i = 0; i < DevicePointerCache::kMaxEntries + 2; ++i) {
    EXPECT_TRUE(cache.IsDevicePointer(device + (i % 64)));
  }
  EXPECT_EQ(cudaFree(device), cudaSuccess);
}

}  // namespace
}  // namespace moe_ep::kernels
