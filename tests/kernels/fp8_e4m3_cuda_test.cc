// core/fp8_e4m3.h against CUDA's own e4m3 conversion (issue 15 item 4):
//  - on the host, E4m3FromFloatPortable equals cuda_fp8.h's host
//    __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) for every bf16
//    value, the hand-worked specials and a sweep of float bit patterns, and
//    E4m3ToFloat equals __nv_cvt_fp8_to_halfraw for all 256 codes (no GPU
//    needed: these run on CPU builds with CUDA);
//  - on the device (skipped without a GPU), the kernels' E4m3FromFloat (the
//    cvt instruction on sm_89+) and E4m3ToFloat give the host's bits.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/fp8_e4m3.h"
#include "kernels/fp8_dispatch.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace {

using testing::DeviceBuffer;

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Every bf16 value (as float), the specials of the hand-worked tests, and
// float bit patterns that land between bf16 values (ties at e4m3's 3 bits
// and subnormal boundaries included).
std::vector<float> Inputs() {
  std::vector<float> in;
  for (uint32_t b = 0; b < 65536; ++b) in.push_back(FromBits(b << 16));
  for (float x : {448.0f, 464.0f, 465.0f, 1.0625f, 1.1875f, 1.9375f, std::ldexp(7.5f, -9),
                  std::ldexp(2.5f, -9), std::ldexp(1.0f, -10), std::ldexp(1.5f, -10), 1e-40f, -0.0f,
                  INFINITY, -INFINITY, NAN, -NAN}) {
    in.push_back(x);
    in.push_back(-x);
  }
  for (uint32_t b = 0x3a000000u; b < 0x44000000u; b += 0x1357u) in.push_back(FromBits(b));
  return in;
}

uint8_t CudaHost(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

float CudaHostDecode(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
  return __half2float(__half(h));
}

TEST(Fp8E4m3Cuda, HostDefinitionEqualsCudaHostConversion) {
  int64_t checked = 0;
  for (float x : Inputs()) {
    ASSERT_EQ(core::fp8::E4m3FromFloatPortable(x), CudaHost(x))
        << "x = " << x << " (bits " << std::hex << core::fp8::FloatBits(x) << ")";
    ++checked;
  }
  EXPECT_GT(checked, 65536 + 32);
  for (int c = 0; c < 256; ++c) {
    const float mine = core::fp8::E4m3ToFloat(static_cast<uint8_t>(c));
    const float cuda = CudaHostDecode(static_cast<uint8_t>(c));
    if (std::isnan(cuda)) {
      EXPECT_TRUE(std::isnan(mine)) << "code " << c;
    } else {
      EXPECT_EQ(core::fp8::FloatBits(mine), core::fp8::FloatBits(cuda)) << "code " << c;
    }
  }
}

TEST(Fp8E4m3Cuda, DeviceConversionEqualsHostBitForBit) {
  MOE_EP_REQUIRE_GPUS(1);
  const std::vector<float> in = Inputs();
  DeviceBuffer<float> d_in(in);
  DeviceBuffer<uint8_t> d_codes(in.size());
  ASSERT_TRUE(
      LaunchE4m3FromFloat(d_in.get(), static_cast<int64_t>(in.size()), d_codes.get(), nullptr)
          .ok());
  DeviceBuffer<float> d_values(256);
  ASSERT_TRUE(LaunchE4m3ToFloatAllCodes(d_values.get(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> codes = d_codes.Download(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    if (std::isnan(in[i])) {
      // The cvt instruction may keep a NaN's sign (0xFF); either is the NaN code.
      EXPECT_EQ(codes[i] & 0x7F, 0x7F) << "NaN input " << i;
      continue;
    }
    ASSERT_EQ(codes[i], core::fp8::E4m3FromFloatPortable(in[i]))
        << "x = " << in[i] << " (bits " << std::hex << core::fp8::FloatBits(in[i]) << ")";
  }
  const std::vector<float> values = d_values.Download(256);
  for (int c = 0; c < 256; ++c) {
    const float host = core::fp8::E4m3ToFloat(static_cast<uint8_t>(c));
    if (std::isnan(host)) {
      EXPECT_TRUE(std::isnan(values[c])) << "code " << c;
    } else {
      EXPECT_EQ(core::fp8::FloatBits(values[c]), core::fp8::FloatBits(host)) << "code " << c;
    }
  }
}

// The dequantizing pass on hand-made wire rows: codes and scales in, the
// host's DequantizeValue out; ids and weights copied.
TEST(Fp8E4m3Cuda, DequantizePassEqualsHost) {
  MOE_EP_REQUIRE_GPUS(1);
  constexpr int64_t kH = 256;
  constexpr int kK = 2;
  constexpr int64_t kRows = 3;
  const int64_t wire_bytes = Fp8DispatchRowBytes(kH, kK);
  ASSERT_EQ(wire_bytes, 256 + 8 + 16);
  std::vector<uint8_t> wire(kRows * wire_bytes);
  for (int64_t r = 0; r < kRows; ++r) {
    uint8_t* row = wire.data() + r * wire_bytes;
    for (int64_t i = 0; i < kH; ++i) row[i] = static_cast<uint8_t>((i * 7 + r * 31) % 256);
    const float scales[2] = {0.0078125f * (r + 1), 3.0f / 448.0f};
    std::memcpy(row + kH, scales, sizeof(scales));
    const int32_t ids[kK] = {static_cast<int32_t>(r), -1};
    const float weights[kK] = {0.5f, 0.0f};
    std::memcpy(row + kH + 8, ids, sizeof(ids));
    std::memcpy(row + kH + 8 + 8, weights, sizeof(weights));
  }
  DeviceBuffer<uint8_t> d_wire(wire);
  const int64_t out_bytes = 2 * kH + 8 * kK;
  DeviceBuffer<uint8_t> d_out(kRows * out_bytes);
  ASSERT_TRUE(LaunchDequantizeDispatchRows(d_wire.get(), kRows, kH, kK, d_out.get(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> out = d_out.Download(kRows * out_bytes);
  for (int64_t r = 0; r < kRows; ++r) {
    const uint8_t* src = wire.data() + r * wire_bytes;
    const uint8_t* dst = out.data() + r * out_bytes;
    float scales[2];
    std::memcpy(scales, src + kH, sizeof(scales));
    for (int64_t i = 0; i < kH; ++i) {
      uint16_t got;
      std::memcpy(&got, dst + 2 * i, 2);
      const uint16_t want = core::fp8::DequantizeValue(src[i], scales[i / 128]);
      if ((src[i] & 0x7F) == 0x7F) {
        EXPECT_EQ(got & 0x7F80, 0x7F80) << "NaN code, row " << r << " value " << i;
      } else {
        ASSERT_EQ(got, want) << "row " << r << " value " << i;
      }
    }
    EXPECT_EQ(std::memcmp(dst + 2 * kH, src + kH + 8, 8 * kK), 0) << "row " << r;
  }
  // Host checks of the launcher.
  EXPECT_EQ(LaunchDequantizeDispatchRows(d_wire.get(), 1, 64, kK, d_out.get(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe_ep::kernels
