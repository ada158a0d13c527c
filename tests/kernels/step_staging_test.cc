#include "kernels/step_staging.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace moe_ep::kernels {
namespace {

TEST(DeviceTokensSent, SumsTheDeviceSendCounts) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) GTEST_SKIP() << "needs a CUDA device";
  const int32_t counts[3] = {5, 0, 11};
  int32_t* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, sizeof(counts)), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(device, counts, sizeof(counts), cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  absl::StatusOr<int64_t> all = DeviceTokensSent(device, 3, stream);
  absl::StatusOr<int64_t> first_two = DeviceTokensSent(device, 2, stream);
  cudaStreamDestroy(stream);
  cudaFree(device);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_TRUE(first_two.ok()) << first_two.status();
  EXPECT_EQ(*all, 16);
  EXPECT_EQ(*first_two, 5);
}

// Bytes(): four parts, each rounded up to 128 bytes. N 3, H 10, K 2: hidden
// and output 60 -> 128 bytes each, ids and weights 24 -> 128 each. N 100,
// H 7168, K 8: 1,433,600 (aligned) twice and 3,200 -> 3,200 twice.
TEST(StepStaging, BytesAreFourPartsAlignedTo128) {
  EXPECT_EQ(StepStaging::Bytes(3, 10, 2), 512);
  EXPECT_EQ(StepStaging::Bytes(100, 7168, 8), 2 * 1433600 + 2 * 3200);
  EXPECT_EQ(StepStaging::Bytes(0, 7168, 8), 0);
}

// A block bound to the caller's memory (the NCCL dispatcher's tail): no
// CUDA call is made, the parts sit at the aligned offsets 0, 128, 256, 384,
// Rebind moves them, and without the mirror the host parts are null.
TEST(StepStaging, BoundBlockPartsFollowRebind) {
  alignas(128) static char block[2][512];
  absl::StatusOr<std::unique_ptr<StepStaging>> s =
      StepStaging::Create(3, 10, 2, {.device = block[0], .pinned_host = false});
  ASSERT_TRUE(s.ok()) << s.status();
  const StepStaging& st = **s;
  EXPECT_EQ(st.bytes(), 512);
  EXPECT_EQ(reinterpret_cast<char*>(st.hidden()), block[0]);
  EXPECT_EQ(reinterpret_cast<char*>(st.topk_ids()), block[0] + 128);
  EXPECT_EQ(reinterpret_cast<char*>(st.topk_weights()), block[0] + 256);
  EXPECT_EQ(reinterpret_cast<char*>(st.output()), block[0] + 384);
  EXPECT_EQ(st.host_hidden(), nullptr);
  EXPECT_EQ(st.host_counts(), nullptr);
  (*s)->Rebind(block[1]);
  EXPECT_EQ(reinterpret_cast<char*>(st.output()), block[1] + 384);
}

// Allocated here with the pinned mirror: the mirror has the same parts and
// then the counts; Upload stages host rows into the device parts.
TEST(StepStaging, OwnedBlockWithPinnedMirrorUploadsRows) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) GTEST_SKIP() << "needs a CUDA device";
  absl::StatusOr<std::unique_ptr<StepStaging>> s =
      StepStaging::Create(3, 10, 2, {.device = nullptr, .pinned_host = true});
  ASSERT_TRUE(s.ok()) << s.status();
  const StepStaging& st = **s;
  char* host = static_cast<char*>(st.host_hidden());
  EXPECT_EQ(static_cast<char*>(st.host_topk_ids()), host + 128);
  EXPECT_EQ(static_cast<char*>(st.host_output()), host + 384);
  EXPECT_EQ(reinterpret_cast<char*>(st.host_counts()), host + 512);
  std::vector<uint16_t> hidden(2 * 10);
  std::vector<int32_t> ids = {0, 3, 7, -1};
  std::vector<float> weights = {0.5f, 0.25f, 1.0f, 0.0f};
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = static_cast<uint16_t>(i * 7 + 1);
  ASSERT_TRUE(st.Upload(hidden.data(), ids.data(), weights.data(), 2, nullptr).ok());
  std::vector<uint16_t> hidden_back(hidden.size());
  std::vector<int32_t> ids_back(ids.size());
  std::vector<float> weights_back(weights.size());
  ASSERT_EQ(cudaMemcpy(hidden_back.data(), st.hidden(), hidden.size() * 2, cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(ids_back.data(), st.topk_ids(), 16, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(weights_back.data(), st.topk_weights(), 16, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(hidden_back, hidden);
  EXPECT_EQ(ids_back, ids);
  EXPECT_EQ(weights_back, weights);
}

}  // namespace
}  // namespace moe_ep::kernels
