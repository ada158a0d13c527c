#include "server/tensor_codec.h"

#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::Tensor Raw(v1::DType dtype, const std::vector<int64_t>& shape, size_t bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::string(bytes, '\0'));
  return t;
}

TEST(ValidateTensor, ByteLengthMismatchNamesFieldShapeAndBoth) {
  absl::Status s = ValidateTensor(Raw(v1::DTYPE_BF16, {2, 2048}, 100), "hidden_states", 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "hidden_states.data: expected 8192 bytes for shape [2, 2048] bf16, got 100");
}

TEST(ValidateTensor, UnknownAndUnspecifiedDType) {
  v1::Tensor t = Raw(v1::DTYPE_FP32, {1}, 4);
  t.set_dtype(static_cast<v1::DType>(7));
  absl::Status s = ValidateTensor(t, "topk_weights", 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("topk_weights.dtype"));
  EXPECT_THAT(s.message(), HasSubstr("unknown value 7"));
  t.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_THAT(ValidateTensor(t, "x", 1).message(), HasSubstr("x.dtype"));
  EXPECT_THAT(ValidateTensor(t, "x", 1).message(), HasSubstr("DTYPE_UNSPECIFIED"));
}

TEST(ValidateTensor, WrongRankAndNegativeDim) {
  absl::Status s = ValidateTensor(Raw(v1::DTYPE_INT32, {6}, 24), "topk_ids", 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("topk_ids.shape: expected 2 dims, got 1"));
  s = ValidateTensor(Raw(v1::DTYPE_INT32, {-1, 2}, 0), "topk_ids", 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("topk_ids.shape[0]: expected >= 0, got -1"));
}

TEST(ValidateTensor, HugeShapeDoesNotOverflow) {
  absl::Status s = ValidateTensor(Raw(v1::DTYPE_FP32, {1 << 30, 1 << 30, 1 << 30}, 0), "h", 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("h.shape"));
}

TEST(ValidateTensor, ZeroRowsIsValid) {
  EXPECT_TRUE(ValidateTensor(Raw(v1::DTYPE_BF16, {0, 64}, 0), "hidden_states", 2).ok());
}

TEST(DecodeBf16, ConvertsFp32WithRoundToNearestEven) {
  // 1.0 -> 0x3F80; 1 + 2^-8 is a tie between 0x3F80 and 0x3F81 -> even 0x3F80;
  // 1 + 3*2^-8 ties between 0x3F81 and 0x3F82 -> even 0x3F82; -2.5 -> 0xC020.
  const float values[4] = {1.0f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -2.5f};
  v1::Tensor t = EncodeFloat32(values, std::vector<int64_t>{2, 2});
  auto decoded = DecodeBf16(t, "hidden_states", 2);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_THAT(decoded->shape, ElementsAre(2, 2));
  EXPECT_THAT(decoded->values, ElementsAre(0x3F80, 0x3F80, 0x3F82, 0xC020));
}

TEST(DecodeBf16, RoundTripsBf16AndRejectsInt32) {
  const core::bf16_t values[3] = {0x3F80, 0x4000, 0xBF80};
  v1::Tensor t = EncodeBf16(values, std::vector<int64_t>{1, 3});
  EXPECT_EQ(t.data().size(), 6u);
  EXPECT_EQ(static_cast<unsigned char>(t.data()[0]), 0x80);  // little-endian
  EXPECT_EQ(static_cast<unsigned char>(t.data()[1]), 0x3F);
  auto decoded = DecodeBf16(t, "hidden_states", 2);
  ASSERT_TRUE(decoded.ok());
  EXPECT_THAT(decoded->values, ElementsAre(0x3F80, 0x4000, 0xBF80));

  const int32_t ids[2] = {1, 2};
  auto bad = DecodeBf16(EncodeInt32(ids, std::vector<int64_t>{1, 2}), "hidden_states", 2);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("hidden_states.dtype: expected bf16 or fp32, got int32"));
}

TEST(DecodeInt32AndFloat32, RequireTheirDType) {
  const int32_t ids[4] = {3, -1, 9, 30};
  auto decoded = DecodeInt32(EncodeInt32(ids, std::vector<int64_t>{2, 2}), "topk_ids", 2);
  ASSERT_TRUE(decoded.ok());
  EXPECT_THAT(decoded->values, ElementsAre(3, -1, 9, 30));
  const float w[2] = {0.25f, 0.75f};
  auto weights = DecodeFloat32(EncodeFloat32(w, std::vector<int64_t>{1, 2}), "topk_weights", 2);
  ASSERT_TRUE(weights.ok());
  EXPECT_THAT(weights->values, ElementsAre(0.25f, 0.75f));

  auto wrong = DecodeFloat32(EncodeInt32(ids, std::vector<int64_t>{2, 2}), "topk_weights", 2);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("topk_weights.dtype: expected fp32, got int32"));
  auto wrong2 = DecodeInt32(EncodeFloat32(w, std::vector<int64_t>{1, 2}), "topk_ids", 2);
  EXPECT_THAT(wrong2.status().message(), HasSubstr("topk_ids.dtype: expected int32, got fp32"));
}

}  // namespace
}  // namespace moe_ep::server
