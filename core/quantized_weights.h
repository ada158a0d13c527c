#pragma once

// Quantized routed-expert weights held in their checkpoint's bytes (fp8 e4m3
// 128 x 128 block-scaled; mxfp4), never expanded to bf16: the containers,
// their checks, their sizes, the seeded generator and the readers of each
// family's published safetensors layout. The formats themselves (what a byte
// means) are defined in core/quantized_formats.h; the reference compute over
// these containers is core/quantized_expert_compute.h.
//
// Checkpoint layouts read here (names and shapes as published):
//   DeepSeek-V3/R1, Kimi-K2 (fp8), per expert E of layer L:
//     model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight           F8_E4M3 [I, H] / [H, I]
//     model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight_scale_inv F32 [ceil(rows/128),
//                                                                        ceil(cols/128)]
//     (MiniMax-M2.5 names them ...block_sparse_moe.experts.E.w1/w3/w2: the same
//     pattern with {w}).
//   gpt-oss (mxfp4), all experts of layer L in one tensor each:
//     model.layers.L.mlp.experts.gate_up_proj_blocks  U8   [E, 2I, H/32, 16]
//     model.layers.L.mlp.experts.gate_up_proj_scales  U8   [E, 2I, H/32]
//     model.layers.L.mlp.experts.gate_up_proj_bias    BF16 [E, 2I]  (rows interleaved:
//                                                                   2j gate, 2j + 1 up)
//     model.layers.L.mlp.experts.down_proj_blocks     U8   [E, H, I/32, 16]
//     model.layers.L.mlp.experts.down_proj_scales     U8   [E, H, I/32]
//     model.layers.L.mlp.experts.down_proj_bias       BF16 [E, H]
//
// Value types; thread-compatible. Source: DESIGN §7; issue 35 items 1-2.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/bf16.h"
#include "core/quantized_formats.h"
#include "core/safetensors.h"

namespace moe_ep::core::quant {

// "bf16", "fp8-block128", "mxfp4".
const char* ExpertWeightFormatName(ExpertWeightFormat format);

// An fp8 e4m3 weight [rows, cols] with one fp32 scale_inv per 128 x 128
// block (core/quantized_formats.h). rows = N (outputs), cols = K (inputs).
struct Fp8BlockMatrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> codes;    // [rows, cols] e4m3
  std::vector<float> scale_inv;  // [Fp8ScaleBlocks(rows), Fp8ScaleBlocks(cols)]

  int64_t scale_rows() const { return Fp8ScaleBlocks(rows); }
  int64_t scale_cols() const { return Fp8ScaleBlocks(cols); }
  // scale_inv of the block holding (n, k).
  float ScaleInv(int64_t n, int64_t k) const {
    return scale_inv[(n / kFp8Block) * scale_cols() + k / kFp8Block];
  }
  // The dequantized weight, exact: e4m3(codes[n, k]) * ScaleInv(n, k) in fp64.
  double Value(int64_t n, int64_t k) const;
  // Bytes held: rows * cols + 4 * scale blocks.
  int64_t bytes() const;
};

// An mxfp4 weight [rows, cols] (cols a multiple of 32): e2m1 values, two a
// byte, and one E8M0 scale per 32 values along cols.
struct Mxfp4Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> blocks;  // [rows, cols / 32, 16]
  std::vector<uint8_t> scales;  // [rows, cols / 32]

  // The dequantized weight (exact; Mxfp4Value).
  float Value(int64_t n, int64_t k) const {
    return Mxfp4Value(blocks.data(), scales.data(), cols, n, k);
  }
  // Bytes held: rows * cols / 2 + rows * cols / 32.
  int64_t bytes() const;
};

// One DeepSeek-style SwiGLU expert in fp8: gate, up [I, H], down [H, I].
struct Fp8SwiGluWeights {
  Fp8BlockMatrix gate;
  Fp8BlockMatrix up;
  Fp8BlockMatrix down;
};

// One gpt-oss expert in mxfp4: gate_up [2I, H] with rows interleaved (2j
// gate, 2j + 1 up, as the checkpoint stores them), its bias [2I], down
// [H, I] and its bias [H] (bf16 bit patterns).
struct GptOssExpertWeights {
  Mxfp4Matrix gate_up;
  std::vector<bf16_t> gate_up_bias;
  Mxfp4Matrix down;
  std::vector<bf16_t> down_bias;
};

// Bytes of one matrix [rows, cols] in each format: fp8 rows * cols +
// 4 * ceil(rows/128) * ceil(cols/128); mxfp4 rows * cols * 17 / 32 (REQUIRES
// cols % 32 == 0); bf16 2 * rows * cols.
int64_t MatrixBytes(ExpertWeightFormat format, int64_t rows, int64_t cols);

// ExpertWeightBytes()
//
// Bytes of one routed expert's weights of hidden H and intermediate I as the
// format stores them: gate/up [I, H] and down [H, I] (bf16, fp8), or
// gate_up [2I, H] + down [H, I] + the bf16 biases 2I + H (mxfp4, gpt-oss).
// Examples: DeepSeek-V3 (H 7168, I 2048) bf16 88,080,384; fp8 44,040,192 +
// 10,752 scale bytes = 44,050,944; gpt-oss (H 2880, I 2880) mxfp4
// 13,219,200 + 17,280 bias bytes = 13,236,480.
int64_t ExpertWeightBytes(ExpertWeightFormat format, int64_t hidden, int64_t intermediate);

// CheckFp8BlockMatrix() / CheckMxfp4Matrix()
//
// OK when the matrix is [rows, cols] as expected and its vectors have the
// sizes of the format. Errors (kInvalidArgument, naming `name`, expected and
// got): a dimension differs; codes/blocks size; a scale grid that does not
// tile the weight (scale_inv not [ceil(rows/128), ceil(cols/128)], scales
// not [rows, cols/32]); mxfp4 cols not a multiple of 32.
absl::Status CheckFp8BlockMatrix(const Fp8BlockMatrix& m, int64_t rows, int64_t cols,
                                 const std::string& name);
absl::Status CheckMxfp4Matrix(const Mxfp4Matrix& m, int64_t rows, int64_t cols,
                              const std::string& name);

// QuantizeFp8Block()
//
// The fp8 block-scaled form of a bf16 matrix w [rows, cols] (row-major), as
// DeepSeek's weight quantization makes it: per 128 x 128 block scale_inv =
// amax / 448 (1 when amax is 0) and codes e4m3(w / scale_inv)
// (fp8::BlockScale, fp8::QuantizeValue). REQUIRES: w.size() == rows * cols.
// Pure; runs on all cores for large matrices (bits independent of the split).
Fp8BlockMatrix QuantizeFp8Block(const std::vector<bf16_t>& w, int64_t rows, int64_t cols);

// QuantizeMxfp4()
//
// The mxfp4 form of a bf16 matrix w [rows, cols] (cols % 32 == 0): per block
// of 32 along cols the E8M0 byte Mxfp4ScaleFor(amax) and the codes
// E2m1FromFloat(w / scale) (OCP MX v1.0 conversion). REQUIRES: w.size() ==
// rows * cols, cols % 32 == 0. Pure.
Mxfp4Matrix QuantizeMxfp4(const std::vector<bf16_t>& w, int64_t rows, int64_t cols);

// GenerateFp8SwiGlu()
//
// Seeded fp8 weights of expert `expert` of layer `layer`: the bf16 weights
// ExpertSet::GenerateSwiGlu makes for (seed, layer, expert) (core/seeded_stream.h),
// each quantized with QuantizeFp8Block. A device generator makes the same
// bits from the same stream and the same block rule.
// Errors: kInvalidArgument for hidden or intermediate < 1.
absl::StatusOr<Fp8SwiGluWeights> GenerateFp8SwiGlu(uint64_t seed, int layer, int expert,
                                                   int64_t hidden, int64_t intermediate);

// GenerateGptOssExpert()
//
// Seeded gpt-oss weights: gate_up row 2j is the seeded gate row j and row
// 2j + 1 the seeded up row j (the bf16 stream of GenerateSwiGlu), down the
// seeded down, each quantized with QuantizeMxfp4; the biases are the seeded
// bf16 tensors SeededProjection::kGateUpBias [2I] and kDownBias [H], uniform
// in +-1/sqrt(H) and +-1/sqrt(I).
// Errors: kInvalidArgument for hidden or intermediate < 1 or not a
// multiple of 32 (the mxfp4 block), naming the field.
absl::StatusOr<GptOssExpertWeights> GenerateGptOssExpert(uint64_t seed, int layer, int expert,
                                                         int64_t hidden, int64_t intermediate);

// ReadFp8BlockMatrix()
//
// The fp8 weight `weight_name` (F8_E4M3 [rows, cols]) and its scales
// `scale_name` (F32 [ceil(rows/128), ceil(cols/128)]) from `ckpt`, bytes as
// stored. Errors: kNotFound naming a missing tensor (a weight without its
// weight_scale_inv says so); kInvalidArgument naming the tensor for a wrong
// dtype (e.g. BF16 where F8_E4M3 is expected), a wrong shape, or a scale
// grid that does not tile the weight (expected and got).
absl::StatusOr<Fp8BlockMatrix> ReadFp8BlockMatrix(SafetensorsCheckpoint& ckpt,
                                                  const std::string& weight_name,
                                                  const std::string& scale_name, int64_t rows,
                                                  int64_t cols);

// The two tensors of an fp8 block-scaled weight, unread: views into the
// checkpoint's mapping (valid while `ckpt` lives). weight.data holds the
// rows * cols e4m3 codes, scale_inv.data the grid's F32 values
// little-endian, both as the file stores them.
struct Fp8BlockTensorViews {
  SafetensorsTensorView weight;
  SafetensorsTensorView scale_inv;
};

// FindFp8BlockMatrix()
//
// ReadFp8BlockMatrix's checks from the headers alone, no tensor data read:
// a loader that streams the bytes (kernels::DeviceExpertSet::Load, issue 35
// item 2) checks every tensor first, then copies. Same errors.
absl::StatusOr<Fp8BlockTensorViews> FindFp8BlockMatrix(SafetensorsCheckpoint& ckpt,
                                                       const std::string& weight_name,
                                                       const std::string& scale_name, int64_t rows,
                                                       int64_t cols);

// The names of one gpt-oss layer's expert tensors: `prefix` with {layer}
// replaced, followed by gate_up_proj_blocks etc. Default prefix
// "model.layers.{layer}.mlp.experts." (the published checkpoints).
inline constexpr char kGptOssExpertPrefix[] = "model.layers.{layer}.mlp.experts.";

// ReadGptOssExperts()
//
// Experts `expert_ids` (each in [0, num_experts)) of layer `layer` from the
// fused gpt-oss tensors under `prefix` (see the header comment), as stored:
// the [E, ...] tensors are sliced per expert without conversion.
// Errors: kNotFound naming a missing tensor; kInvalidArgument naming the
// tensor for a wrong dtype (U8 blocks/scales, BF16/F16/F32 bias), a shape
// other than the published [E, 2I, H/32, 16] / [E, 2I, H/32] / [E, 2I] /
// [E, H, I/32, 16] / [E, H, I/32] / [E, H] (expected and got; a scale
// tensor that does not tile its blocks is one of these), H or I not a
// multiple of 32.
absl::StatusOr<std::vector<GptOssExpertWeights>> ReadGptOssExperts(
    SafetensorsCheckpoint& ckpt, const std::string& prefix, int layer, int num_experts,
    const std::vector<int>& expert_ids, int64_t hidden, int64_t intermediate);

// The tensors of gpt-oss experts [0, experts.size()) of one layer in the
// published layout (names under `prefix` with {layer} = layer, dtypes,
// shapes), for tests and converters. REQUIRES: every expert [2I, H] / [H, I].
std::vector<SafetensorsTensor> GptOssTensors(const std::vector<GptOssExpertWeights>& experts,
                                             const std::string& prefix, int layer);

// The two tensors of one fp8 weight: `weight_name` F8_E4M3 [rows, cols] and
// `scale_name` F32 scale grid.
std::vector<SafetensorsTensor> Fp8Tensors(const Fp8BlockMatrix& m, const std::string& weight_name,
                                          const std::string& scale_name);

}  // namespace moe_ep::core::quant
