#pragma once

// The experts of one MoE layer held by one rank on its GPU (DESIGN §7):
// SwiGLU weights in bf16, laid out for the grouped GEMMs of
// kernels/expert_compute.h, fp8 block-scaled SwiGLU weights (DeepSeek-V3's
// checkpoint format, Fp8SwiGluExperts below; issue 35 item 3), gpt-oss's
// mxfp4 experts (Mxfp4Experts below), or identity experts (no weights).
//
// Device layout (row-major bf16):
//   gate_up [L, 2I, H]: rows [0, I) of slot l are gate, rows [I, 2I) up
//   down    [L, H, I]
//   slot ids [L] int32 (device_slot_ids())
// with L = num_experts() local slots, H = hidden, I = intermediate.
//
// Slots, not ranges (DESIGN §17, issue 34 item 2): slot l holds the weights
// of logical expert expert_ids()[l], any ascending set of distinct ids (a
// rank's distinct placement-table experts, core::DistinctSlotExperts, need
// not be one range), and answers to slot_ids()[l] in the ids the received
// rows carry: the logical ids on the NCCL plane, the dispatch ids of
// server/onesided_route_map.h on the one-sided plane (Renumber). Kernels
// find a row's slot with core::LocalSlot over device_slot_ids(), never as
// id - first.
//
// Weights come from a core::ExpertSource (Load: seeded weights generated on
// the device, checkpoint tensors streamed through a bounded pinned buffer,
// no host copy of the set) or from a host core::ExpertSet (Upload: tests,
// benchmarks); either way the GPU holds bit-identical weights to the CPU
// reference. Not thread-safe; owns its device memory.
// Source: DESIGN §7; issue 3 (expert weights held on the GPU); issue 10
// item 6 (the GPU path never builds host weights).

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/expert_source.h"
#include "core/experts.h"
#include "core/quantized_expert_compute.h"
#include "core/quantized_weights.h"

namespace moe_ep::kernels {

// fp8 block-scaled SwiGLU experts of one rank on its GPU, the DeepSeek-V3
// checkpoint format (DESIGN §7 "Weight formats"; issue 35 item 3), as
// non-owning device pointers. Per local expert l the checkpoint's tensors go
// here unchanged: gate_proj.weight [I, H] to gate_up[l] rows [0, I),
// up_proj.weight to rows [I, 2I), their weight_scale_inv [I/128, H/128] to
// gate_up_scale[l][0] and [l][1], down_proj.weight [H, I] and its
// weight_scale_inv [H/128, I/128] to down[l] and down_scale[l]. A weight is
// code * scale of its 128 x 128 block; slot l holds the expert that
// slot_ids[l] names (kernels/device_experts.h's slots).
struct Fp8SwiGluExperts {
  const int32_t* slot_ids = nullptr;     // device [L]: the id slot l answers to, ascending
                                         // (core::LocalSlot, as DeviceExpertSet)
  int num_experts = 0;                   // L
  int64_t hidden = 0;                    // H, a multiple of 128
  int64_t intermediate = 0;              // I, a multiple of 128
  const uint8_t* gate_up = nullptr;      // [L, 2I, H] e4m3, 16-byte aligned
  const float* gate_up_scale = nullptr;  // [L, 2, I/128, H/128] fp32
  const uint8_t* down = nullptr;         // [L, H, I] e4m3, 16-byte aligned
  const float* down_scale = nullptr;     // [L, H/128, I/128] fp32
  bool scales_input = false;             // e(w * x), Llama-4 (router_weight_use)
};

// gpt-oss's mxfp4 experts of one rank on its GPU (issue 35 item 3), as
// non-owning device pointers, each slot's tensors as the checkpoint stores
// them (core/quantized_formats.h): gate_up blocks [2I, H/32, 16] (row 2j the
// gate and 2j + 1 the up of feature j), scales [2I, H/32] E8M0, bias [2I]
// bf16; down blocks [H, I/32, 16], scales [H, I/32], bias [H]; slot l at
// offset l times each one's size. Slot l holds the expert slot_ids[l] names.
struct Mxfp4Experts {
  const int32_t* slot_ids = nullptr;         // device [L], ascending (core::LocalSlot)
  int num_experts = 0;                       // L
  int64_t hidden = 0;                        // H
  int64_t intermediate = 0;                  // I
  const uint8_t* gate_up_blocks = nullptr;   // [L, 2I, H/32, 16]
  const uint8_t* gate_up_scales = nullptr;   // [L, 2I, H/32]
  const uint16_t* gate_up_bias = nullptr;    // [L, 2I] bf16
  const uint8_t* down_blocks = nullptr;      // [L, H, I/32, 16]
  const uint8_t* down_scales = nullptr;      // [L, H, I/32]
  const uint16_t* down_bias = nullptr;       // [L, H] bf16
  core::quant::GptOssActivation activation;  // swiglu_limit and alpha
  bool scales_input = false;                 // e(w * x) (router_weight_use)
};

// Default pinned staging of DeviceExpertSet::Load: 64 MiB (two 32 MiB
// buffers, more than one DeepSeek-V3 expert tensor of 2048 x 7168 bf16).
inline constexpr int64_t kExpertStagingBytes = int64_t{64} << 20;

class DeviceExpertSet {
 public:
  // Copies `experts` to the current CUDA device (synchronous; not a step-path
  // call); slot l holds experts.expert_ids()[l] (any set, e.g. a
  // core::ExpertSet::Union). bf16 SwiGLU, fp8 SwiGLU, gpt-oss mxfp4 and
  // identity experts. Errors: kResourceExhausted (cudaMalloc failed),
  // kInternal (copy, or host weights of unexpected sizes).
  static absl::StatusOr<std::unique_ptr<DeviceExpertSet>> Upload(const core::ExpertSet& experts);

  // Seeded SwiGLU experts [first_expert, first_expert + num_experts) of
  // `layer`, generated on the current CUDA device by
  // kernels/seeded_weights.cuh: bit-identical to
  // Upload(core::ExpertSet::GenerateSwiGlu(seed, layer, first_expert,
  // num_experts, hidden, intermediate)) without making them on the host.
  // Synchronous (waits for the generation; not a step-path call).
  // Errors: kInvalidArgument (hidden or intermediate < 1, num_experts or
  // first_expert < 0; as core::ExpertSet::GenerateSwiGlu),
  // kResourceExhausted (cudaMalloc failed), kInternal (launch or execution).
  static absl::StatusOr<std::unique_ptr<DeviceExpertSet>> GenerateSwiGlu(uint64_t seed, int layer,
                                                                         int first_expert,
                                                                         int num_experts,
                                                                         int64_t hidden,
                                                                         int64_t intermediate);

  // Load()
  //
  // The experts `source` describes (source.Ids(), any ascending set: slot l
  // holds Ids()[l]), on the current CUDA device, without making them on the
  // host:
  //   kSeeded       GenerateSwiGlu (kernels/seeded_weights.cuh), one launch
  //                 per run of consecutive ids;
  //   kSafetensors  each tensor of each expert (gate, up, down in expert
  //                 order) decoded to bf16 (core::SafetensorsToBf16: the host
  //                 loader's bits) piece by piece into one of two pinned
  //                 buffers of staging_bytes / 2 each, copied to its place
  //                 in gate_up / down on a stream of its own while the other
  //                 buffer fills; each tensor's file pages are released once
  //                 read (core::ReleaseTensorPages), so host memory stays
  //                 about staging_bytes plus one tensor, whatever the layer;
  //   kIdentity     no weights.
  // fp8 block-scaled sources (weight_format kFp8Block128, issue 35): seeded
  // weights are generated in bf16 on the device one expert at a time and
  // quantized there (GenerateFp8SwiGlu's bits, no host copy); checkpoint
  // experts' tensors are all checked from the headers first
  // (core::quant::FindFp8BlockMatrix: dtype, shape, scale grid), then the
  // F8_E4M3 codes and F32 scale_inv stream as stored through the same two
  // pinned buffers, each tensor's pages released once read, so host memory
  // stays about staging_bytes plus one tensor (issue 35 item 2). mxfp4
  // sources (gpt-oss) go one expert at a time through host memory: seeded
  // experts from core::quant::GenerateGptOssExpert, checkpoint experts
  // sliced from the fused tensors by core::quant::ReadGptOssExperts (every
  // tensor's dtype and shape checked on the first, before any device
  // allocation), so the host holds one expert's bytes, never the layer's.
  // The pinned buffers are min(staging_bytes / 2, one tensor's bytes) each,
  // allocated for the call and freed before it returns. Synchronous (not a
  // step-path call).
  // Errors: those of core::ValidateExpertSource and
  // core::OpenExpertCheckpoint (checked before any device allocation),
  // kInvalidArgument (staging_bytes < 4), kResourceExhausted (cudaMalloc or
  // cudaMallocHost), kInternal (copy or launch).
  static absl::StatusOr<std::unique_ptr<DeviceExpertSet>> Load(
      const core::ExpertSource& source, int64_t staging_bytes = kExpertStagingBytes);

  ~DeviceExpertSet();
  DeviceExpertSet(const DeviceExpertSet&) = delete;
  DeviceExpertSet& operator=(const DeviceExpertSet&) = delete;

  core::ExpertKind kind() const { return kind_; }
  // Where the router weight applies (issue 35 item 5): kScalesOutput w * e(x)
  // (default), kScalesInput e(w * x) (Llama-4). From the source (Load) or the
  // host set (Upload); GenerateSwiGlu's sets scale the output.
  core::RouterWeightUse router_weight_use() const { return router_weight_use_; }
  // Local slots (L).
  int num_experts() const { return num_experts_; }
  // The logical expert whose weights each slot holds, ascending [L]; fixed
  // for the set's life.
  const std::vector<int>& expert_ids() const { return expert_ids_; }
  // The id each slot answers to in the received rows, ascending [L]:
  // expert_ids() until Renumber. Kernels read the device copy [L] int32
  // (null when L is 0), valid while the set lives.
  const std::vector<int>& slot_ids() const { return slot_ids_; }
  const int32_t* device_slot_ids() const { return device_slot_ids_; }

  // Renumber()
  //
  // Slot l answers to slot_ids[l] from now on (the weights stay): the
  // one-sided service plane numbers a rank's slots in its dispatcher's id
  // space (server/onesided_route_map.h), which moves under a placement
  // table or a rank mask. A no-op when the ids are the current ones; else
  // the device copy is written on `stream` (ordered after the work already
  // enqueued there, which may still read the old ids) and the stream is
  // waited for, so call it between steps, on the stream the kernels that
  // read the set run on. Errors: kInvalidArgument (slot_ids.size() != L,
  // or not ascending distinct ids >= 0; nothing changes), kInternal (CUDA).
  absl::Status Renumber(const std::vector<int>& slot_ids, cudaStream_t stream);
  int64_t hidden() const { return hidden_; }
  int64_t intermediate() const { return intermediate_; }
  // Device pointers of bf16 SwiGLU weights; null for the other kinds.
  const uint16_t* gate_up() const { return gate_up_; }
  const uint16_t* down() const { return down_; }
  // The fp8 weights (kind() kFp8SwiGlu) as ExpertCompute::RunFp8 reads
  // them; null pointers for the other kinds. Valid while the set lives.
  Fp8SwiGluExperts fp8() const;
  // The mxfp4 weights (kind() kGptOssMxfp4) as ExpertCompute::RunMxfp4
  // reads them; null pointers for the other kinds. Valid while the set lives.
  Mxfp4Experts mxfp4() const;
  // Bytes of device weight storage (the L slot ids, 4 bytes each, are not
  // counted).
  int64_t weight_bytes() const;

 private:
  DeviceExpertSet() = default;
  // Load without the router weight use (Load sets it from the source).
  static absl::StatusOr<std::unique_ptr<DeviceExpertSet>> LoadWeights(
      const core::ExpertSource& source, int64_t staging_bytes);
  // Load of an fp8 checkpoint source: every tensor checked from the headers
  // (core::quant::FindFp8BlockMatrix), then codes and scales streamed as
  // stored through a PinnedUpload, each tensor's pages released once read.
  static absl::StatusOr<std::unique_ptr<DeviceExpertSet>> LoadFp8Checkpoint(
      const core::ExpertSource& source, int64_t staging_bytes);
  // A set of `kind` whose slots hold `ids` (ascending, distinct), with the
  // device slot ids written; no weights yet.
  static absl::StatusOr<std::unique_ptr<DeviceExpertSet>> WithSlots(core::ExpertKind kind,
                                                                    std::vector<int> ids,
                                                                    int64_t hidden,
                                                                    int64_t intermediate);
  // Allocates gate_up_ and down_ for num_experts_ SwiGLU experts.
  absl::Status AllocateSwiGlu();
  // Allocates the fp8 codes and scales for num_experts_ fp8 experts.
  absl::Status AllocateFp8();
  // Copies host fp8 experts (kFp8SwiGlu) into the allocated fp8 buffers.
  absl::Status UploadFp8(const core::ExpertSet& experts);
  // The seeded bf16 weights of every slot's expert, generated on the device
  // one expert at a time and quantized there (LaunchQuantizeFp8BlockMatrices:
  // core::quant::GenerateFp8SwiGlu's bits) into the allocated fp8 buffers;
  // waits for them.
  absl::Status GenerateSeededFp8(uint64_t seed, int layer);
  // Load of an mxfp4 source (kernels/device_experts_mxfp4.cc).
  static absl::StatusOr<std::unique_ptr<DeviceExpertSet>> LoadMxfp4(
      const core::ExpertSource& source);
  // Bytes of one slot's mxfp4 tensors and their offsets in the slab
  // (kernels/device_experts_mxfp4.cc).
  struct Mxfp4Layout;
  Mxfp4Layout Mxfp4Sizes() const;
  int64_t Mxfp4SlotBytes() const;
  // Allocates the mxfp4 slab for num_experts_ experts.
  absl::Status AllocateMxfp4();
  // Copies one expert's host mxfp4 weights into slot `slot` (synchronous).
  // Errors: kInternal (sizes other than [2I, H] / [H, I]; CUDA).
  absl::Status UploadMxfp4(int slot, const core::quant::GptOssExpertWeights& weights);
  // Elements of one expert's gate (or up) scale grid and its down grid.
  int64_t Fp8GateScales() const;
  int64_t Fp8DownScales() const;
  // Generates the seeded weights of every slot's expert into the allocated
  // gate_up_ / down_ and waits for them.
  absl::Status GenerateSeeded(uint64_t seed, int layer);
  core::ExpertKind kind_ = core::ExpertKind::kIdentity;
  core::RouterWeightUse router_weight_use_ = core::RouterWeightUse::kScalesOutput;
  int num_experts_ = 0;
  std::vector<int> expert_ids_;  // [L]
  std::vector<int> slot_ids_;    // [L]
  int32_t* device_slot_ids_ = nullptr;
  int64_t hidden_ = 0;
  int64_t intermediate_ = 0;
  uint16_t* gate_up_ = nullptr;
  uint16_t* down_ = nullptr;
  uint8_t* fp8_gate_up_ = nullptr;      // [L, 2I, H] e4m3
  float* fp8_gate_up_scale_ = nullptr;  // [L, 2, I/128, H/128]
  uint8_t* fp8_down_ = nullptr;         // [L, H, I] e4m3
  float* fp8_down_scale_ = nullptr;     // [L, H/128, I/128]
  uint8_t* mxfp4_ = nullptr;            // Mxfp4Experts' six arrays, one slab
  core::quant::GptOssActivation gpt_oss_activation_;
};

}  // namespace moe_ep::kernels
