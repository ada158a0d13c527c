#include "server/host_forward.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::ElementsAre;

// `values` as little-endian bytes, starting `offset` bytes into the string
// (offset 1 makes every element unaligned).
template <typename T>
std::string BytesAt(const std::vector<T>& values, size_t offset) {
  std::string bytes(offset + values.size() * sizeof(T), '\0');
  std::memcpy(bytes.data() + offset, values.data(), values.size() * sizeof(T));
  return bytes;
}

TEST(HostForwardTensors, AlignedBytesAreReadAndWrittenInPlace) {
  const std::vector<core::bf16_t> hidden = {0x3F80, 0xC000};  // 1.0, -2.0
  const std::vector<int32_t> ids = {3, -1};
  const std::vector<float> weights = {0.25f, 0.75f};
  std::vector<core::bf16_t> output(2, 0);
  HostForward io;
  io.hidden = {reinterpret_cast<const char*>(hidden.data()), 4};
  io.topk_ids = {reinterpret_cast<const char*>(ids.data()), 8};
  io.topk_weights = {reinterpret_cast<const char*>(weights.data()), 8};
  io.output = absl::MakeSpan(reinterpret_cast<char*>(output.data()), 4);
  HostForwardTensors t(io);
  EXPECT_EQ(t.hidden().data(), hidden.data());
  EXPECT_EQ(t.topk_ids().data(), ids.data());
  EXPECT_EQ(t.topk_weights().data(), weights.data());
  EXPECT_EQ(t.output().data(), output.data());
  t.output()[1] = 0x4040;  // 3.0, straight into the caller's output
  EXPECT_THAT(output, ElementsAre(0, 0x4040));
}

TEST(HostForwardTensors, UnalignedBytesAreCopiedAndTheOutputWrittenBackByFinish) {
  const std::string hidden = BytesAt<core::bf16_t>({0x3F80, 0xC000, 0x4040}, 1);
  const std::string ids = BytesAt<int32_t>({7, -1, 2}, 1);
  const std::string weights = BytesAt<float>({0.5f, 1.5f, -2.0f}, 1);
  std::string output(1 + 3 * 2, 'x');
  HostForward io;
  io.hidden = absl::string_view(hidden).substr(1);
  io.topk_ids = absl::string_view(ids).substr(1);
  io.topk_weights = absl::string_view(weights).substr(1);
  io.output = absl::MakeSpan(output.data() + 1, 6);
  HostForwardTensors t(io);
  EXPECT_THAT(t.hidden(), ElementsAre(0x3F80, 0xC000, 0x4040));
  EXPECT_THAT(t.topk_ids(), ElementsAre(7, -1, 2));
  EXPECT_THAT(t.topk_weights(), ElementsAre(0.5f, 1.5f, -2.0f));
  ASSERT_EQ(t.output().size(), 3u);
  t.output()[0] = 0x3F80;
  t.output()[1] = 0xBF80;
  t.output()[2] = 0x0000;
  EXPECT_EQ(output, std::string(7, 'x'));  // staged until Finish
  t.Finish();
  EXPECT_EQ(output, std::string("x\x80\x3F\x80\xBF\x00\x00", 7));
}

TEST(HostForwardTensors, Fp32HiddenIsRoundedToNearestEvenBf16) {
  // 1.0; 1 + 2^-8 (a tie: down to the even 1.0); 1 + 3 * 2^-8 (a tie: up to
  // the even 0x3F82); -0.0; 2^-130 (a subnormal, kept exactly: 0x0008).
  uint32_t bits[] = {0x3F800000u, 0x3F808000u, 0x3F818000u, 0x80000000u, 0x00080000u};
  std::vector<float> values(5);
  std::memcpy(values.data(), bits, sizeof(bits));
  const std::string hidden = BytesAt(values, 0);
  std::vector<core::bf16_t> output(5, 0);
  HostForward io;
  io.hidden = hidden;
  io.hidden_fp32 = true;
  io.output = absl::MakeSpan(reinterpret_cast<char*>(output.data()), 10);
  HostForwardTensors t(io);
  EXPECT_THAT(t.hidden(), ElementsAre(0x3F80, 0x3F80, 0x3F82, 0x8000, 0x0008));
  EXPECT_TRUE(t.topk_ids().empty());
}

TEST(RunOnHostTensors, WritesTheOutputBackOnlyWhenTheStepSucceeds) {
  const std::string hidden = BytesAt<core::bf16_t>({0x3F80}, 1);
  std::string output(3, 'x');
  HostForward io;
  io.hidden = absl::string_view(hidden).substr(1);
  io.output = absl::MakeSpan(output.data() + 1, 2);
  auto fill = [](absl::Span<const core::bf16_t> h, absl::Span<const int32_t>,
                 absl::Span<const float>, absl::Span<core::bf16_t> out) {
    out[0] = h[0];
    return absl::StatusOr<core::StepStats>(core::StepStats{});
  };
  auto fail = [](absl::Span<const core::bf16_t>, absl::Span<const int32_t>, absl::Span<const float>,
                 absl::Span<core::bf16_t> out) {
    out[0] = 0x1234;
    return absl::StatusOr<core::StepStats>(absl::AbortedError("peer"));
  };
  EXPECT_EQ(RunOnHostTensors(io, fail).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(output, "xxx");
  ASSERT_TRUE(RunOnHostTensors(io, fill).ok());
  EXPECT_EQ(output, std::string("x\x80\x3F", 3));
}

}  // namespace
}  // namespace moe_ep::server
