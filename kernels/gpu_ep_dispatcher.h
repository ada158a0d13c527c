#pragma once

// The GPU expert-parallel data plane of one rank (DESIGN §5-§7, §10): the
// same semantics as core::EpDispatcher, on device memory, over NCCL.
//
// Buffers: one cudaMalloc in Create laid out by kernels::GpuWorkspaceLayout
// (never on the step path), plus the expert scratch of
// kernels/expert_compute.h (sized for E * N rows). Options, geometry and the
// step sequence are the contract's (core/ep_contract.h).
// A step with R = runtime_max_tokens_per_rank uses each region packed as
// [E, R, ...] (offsets depend on R, hence the (epoch, R) agreement): slab s of
// the receive region holds source s's tokens for this rank in slots
// 0..count-1 (increasing source-token order), padding slots carry the invalid
// id and zero weights.
//
// Step: route -> pack -> NCCL all-to-all of E x R rows -> experts -> NCCL
// all-to-all of E x R combine rows -> combine reduction, all on the
// collective's stream. The token count T lives in device memory, so a CUDA
// graph captured at a bucket R replays with any T <= R.
//
// (epoch, R) agreement (DESIGN §6), chosen by GpuEpDispatcherOptions::
// geometry_check:
//   kHostAllGather (default, the behaviour the worker service was written
//     against): Forward / Dispatch all-gather (epoch, R) on the host before
//     moving payload (one small synchronous NCCL call) and return kAborted
//     on a mismatch.
//   kDevice: Forward / Dispatch / Combine only enqueue work. Each rank's
//     header {epoch, R, T} travels to every peer in the same NCCL group as
//     the dispatch payload (no extra launch); a one-thread kernel compares
//     them and records the first disagreement in device memory, setting T to
//     0 so the step writes no output row. CheckStep() (the documented sync
//     point) waits for the stream and reports it as kAborted.
// A captured graph always checks on the device (CheckReplay() == CheckStep()).
// A refused step (RefuseStep: this rank's caller failed its checks; issue
// 30 item 1) runs the step's transfers with a header the peers' check
// reads as a refusal: their step writes no output row and their CheckStep
// names the refusing rank, instead of their transfers waiting for it.
// Expert compute: with ExpertGemm::kGroupedDevice (default) SwiGLU reads no
// count on the host, so the whole step, SwiGLU included, is capturable and
// runs with no host sync; kCublasHostCounts keeps the cuBLAS path with its
// one host sync (kernels/expert_compute.h).
// Not thread-safe. Source: DESIGN §6, §7, §10; issue 3.

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/ep_contract.h"
#include "core/ep_dispatcher.h"
#include "core/expert_placement.h"
#include "core/step_dispatcher.h"
#include "kernels/device_experts.h"
#include "kernels/expert_compute.h"
#include "kernels/gpu_workspace_layout.h"
#include "kernels/route.cuh"
#include "kernels/staged_control_collective.h"
#include "kernels/step_header.cuh"
#include "kernels/stream_collective.h"

namespace moe_ep::kernels {

// Where ranks agree on (epoch, R) in Forward / Dispatch (see above).
enum class GeometryCheck {
  kHostAllGather,  // synchronous host all-gather, kAborted from the call
  kDevice,         // on the stream with the payload, kAborted from CheckStep()
};

struct GpuEpDispatcherOptions {
  core::EpDispatcherOptions dispatcher;  // ep_size, capacity N, H, K, dtype (bf16 only),
                                         // num_experts, invalid id, graph buckets
  int64_t max_intermediate = 0;          // I of the largest SwiGLU layer (0: identity only)
  GeometryCheck geometry_check = GeometryCheck::kHostAllGather;
  ExpertGemm expert_gemm = ExpertGemm::kGroupedDevice;  // SwiGLU GEMMs
  // Bytes of a caller's region at the end of the dispatcher's one device
  // allocation (tail()); the GPU data plane stages Forward there, so that one
  // cudaMalloc holds the whole workspace (issue 10 item 2).
  int64_t tail_bytes = 0;
};

// Received rows of one step copied to the host, for tests: [E, R, ...].
struct ReceivedRowsForTest {
  int64_t runtime_max_tokens_per_rank = 0;  // R
  std::vector<uint16_t> hidden;             // [E, R, H] bf16
  std::vector<int32_t> ids;                 // [E, R, K]
  std::vector<float> weights;               // [E, R, K]
};

// The bf16 dispatch rows [rows, DispatchRowBytes(H, K)] at `raw` (host
// bytes) split into their three parts; both device data planes'
// CopyReceivedForTest use it (review duplicate D1).
ReceivedRowsForTest UnpackReceivedRows(const uint8_t* raw, int64_t rows, int64_t hidden, int top_k,
                                       int64_t runtime_max_tokens_per_rank);

class GpuEpDispatcher final : public core::StepDispatcher {
 public:
  // What the GPU data plane cannot do (route.cuh's bounds, H % 4 for the
  // vectorized pack and combine).
  // It moves bf16 and fp8_e4m3 dispatch (kernels/fp8_dispatch.cuh).
  static constexpr core::BackendLimits kGpuLimits = {
      "GPU data plane", kMaxEpSize, kMaxTopK, 4,
      core::DispatchDTypeBit(core::DispatchDType::kBF16) |
          core::DispatchDTypeBit(core::DispatchDType::kFP8E4M3)};

  // `collective` must outlive the dispatcher; its size() is ep_size and its
  // device is current for the allocations.
  // Errors: kInvalidArgument (core::ValidateEpOptions with kGpuLimits;
  // max_intermediate < 0), kResourceExhausted (total device bytes >
  // memory_cap_bytes when > 0, or cudaMalloc failed).
  static absl::StatusOr<std::unique_ptr<GpuEpDispatcher>> Create(
      StreamCollective* collective, const GpuEpDispatcherOptions& options,
      int64_t memory_cap_bytes);
  ~GpuEpDispatcher() override;
  GpuEpDispatcher(const GpuEpDispatcher&) = delete;
  GpuEpDispatcher& operator=(const GpuEpDispatcher&) = delete;

  // Device bytes held, all in one cudaMalloc: layout().total_bytes, then the
  // expert scratch (expert_scratch_bytes()), then the caller's tail_bytes,
  // then the placement table and load counters (DESIGN §15: replica offsets
  // [E + 1] int32, replica ranks [ep_size * slot budget] int32, counters
  // [num_experts] uint64, each 128-byte aligned).
  int64_t allocated_bytes() const override { return placement_offset_ + placement_bytes_; }
  // Where the placement table and load counters start in the one allocation
  // (after the tail, 128-byte aligned), and their bytes.
  int64_t placement_offset() const { return placement_offset_; }
  int64_t placement_bytes() const { return placement_bytes_; }
  // The caller's region (options.tail_bytes bytes, 128-byte aligned; null
  // when tail_bytes is 0). Valid while the dispatcher lives.
  void* tail() const { return tail_; }
  // The one allocation's regions.
  const GpuWorkspaceLayout& layout() const { return layout_; }
  // What the expert compute says its scratch is (kernels/expert_compute.h):
  // its slab, which follows layout() in the one allocation.
  int64_t expert_scratch_bytes() const { return expert_compute_->allocated_bytes(); }
  cudaStream_t stream() const { return collective_->stream(); }
  // The step's token counts on the device, [2, E] int32: row 0 = tokens this
  // rank sends to each rank (the route's send_counts), row 1 = tokens each
  // rank sent to this one (exchanged in the dispatch payload's NCCL group, no
  // extra launch or host sync). Written on stream() by every Dispatch /
  // Forward / replay; read them after it (a copy on stream()). What the
  // Forward RPC's counters come from (issue 11 item 2).
  const int32_t* step_counts() const { return send_counts_; }

  // SetPlacement()
  //
  // Writes `table` into the device copy the route and pack kernels read
  // (DESIGN §15), in place: the buffers were sized at Create by the slot
  // budget (core::SlotBudgetPerRank), so nothing is reallocated and graphs
  // captured earlier route by the new table when replayed. Waits for the
  // stream first (a step boundary), then copies; a no-op when `table` is
  // the one installed (same fingerprint). Create installs the contiguous
  // table. A rank may hold any set of logical experts (DESIGN §17): from
  // then on Forward / ComputeExperts take a DeviceExpertSet whose slot_ids()
  // are this rank's distinct slot experts (core::DistinctSlotExperts).
  // Errors: kFailedPrecondition (a step is in flight), kInvalidArgument
  // (core::ValidatePlacement), CUDA errors. On error the previous table
  // stays.
  absl::Status SetPlacement(const core::PlacementTable& table);
  uint64_t placement_fingerprint() const { return placement_fingerprint_; }

  // ReadExpertLoad()
  //
  // The device load counters (tokens per logical expert, bumped by the route
  // kernel of every step since the last reset; no host sync on the step
  // path), copied to the host after the stream is done; with `reset`,
  // zeroed on the stream after the copy. `steps` is the Forward / Dispatch
  // calls and replays enqueued since the last reset. Errors: CUDA and
  // collective (Synchronize) errors.
  absl::StatusOr<core::ExpertLoadCounts> ReadExpertLoad(bool reset);

  // As core::EpDispatcher: all-gathers local token counts (collective).
  absl::StatusOr<std::vector<int64_t>> SyncTokenCounts(int64_t local_tokens);
  // core::GeometryState::Commit: kFailedPrecondition (a dispatched step is
  // in flight), kResourceExhausted (R > N), kInvalidArgument (R <
  // local_tokens or R < 0); previous geometry kept on error.
  absl::Status CommitGeometry(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                              int64_t local_tokens) override;
  int64_t epoch() const { return geometry_.epoch(); }
  int64_t runtime_max_tokens_per_rank() const { return geometry_.runtime_max_tokens_per_rank(); }
  bool geometry_committed() const { return geometry_.committed(); }
  // A step is dispatched and not yet combined (or refused): the peers'
  // combine waits for this rank's (RefuseCombine has something to refuse).
  bool in_step() const { return geometry_.in_step(); }
  // core::GeometryState::CheckStep: a committed geometry and 0 <= T <= R.
  absl::Status CheckStep(const char* call, int64_t num_tokens) const {
    return geometry_.CheckStep(call, num_tokens);
  }

  // One MoE layer on device pointers: hidden [T, H] bf16, topk_ids [T, K],
  // topk_weights [T, K], output [T, H] bf16 (null allowed when T == 0).
  // Verifies on the host that all ranks agree on the committed (epoch, R),
  // then enqueues the step on stream() and returns; call
  // collective->Synchronize() (or sync the stream) before reading output.
  // Errors: kFailedPrecondition (no geometry committed), kInvalidArgument
  // (T < 0, T > R, null pointers with T > 0, experts' H or slot ids not
  // this rank's: core::ValidateExpertSlice), kAborted (a rank disagrees on
  // (epoch, R), naming it), collective and CUDA errors.
  absl::Status Forward(const uint16_t* hidden, const int32_t* topk_ids, const float* topk_weights,
                       int64_t num_tokens, const DeviceExpertSet& experts, uint16_t* output);

  // The three phases of Forward, for benchmarks: Dispatch (route, pack,
  // all-to-all) -> ComputeExperts -> Combine (all-to-all, reduction), each
  // enqueued on stream(). Dispatch does the same host (epoch, R) check as
  // Forward. Errors: as Forward, plus kFailedPrecondition for a second
  // Dispatch before Combine or ComputeExperts/Combine without Dispatch.
  absl::Status Dispatch(const uint16_t* hidden, const int32_t* topk_ids, const float* topk_weights,
                        int64_t num_tokens);
  absl::Status ComputeExperts(const DeviceExpertSet& experts);
  // `shared_out` (device [T, H] bf16, null = none): this rank's shared-expert
  // term, added to each token's fp32 sum before the cast (issue 18). The
  // caller orders its producer before this call on stream() (an event).
  // `expert_out` (device [E, R, H] bf16, null = the expert compute's output
  // in the workspace): the caller's expert outputs, sent as they are (an
  // engine that runs its own experts, server/moe_ep.h; no copy). The step
  // header rides in the combine's exchange: when a peer refused its combine
  // (RefuseCombine) no output row is written here and CheckStep names it.
  absl::Status Combine(uint16_t* output, const uint16_t* shared_out = nullptr,
                       const uint16_t* expert_out = nullptr);

  // RefuseStep()
  //
  // In place of the Dispatch (and the Combine after it) this rank's caller
  // could not make because its arguments failed the checks (issue 30 item
  // 1): enqueues on stream() the transfers of a whole step at the committed
  // R, so every rank's NCCL calls still match in order and size: the step
  // header with T = kRefusedStepTokens for the peers (0 here), the count
  // exchange with zero counts, the dispatch all-to-all of E x R padding rows
  // (the invalid id, zero weights), then the combine's exchange (the header
  // again and E x R rows) and a reduction that writes no row. The peers'
  // own Dispatch and
  // Combine of that step run as usual, their header check sets their T to
  // 0 (no output row) and records the refusal, so each peer's next
  // CheckStep is kAborted "rank r refused its dispatch of the step at
  // epoch e ..." and the group stays usable; this rank's CheckStep reports
  // nothing for it (its caller has the error). The step is then over here:
  // no Combine follows (a Combine is kFailedPrecondition). Under
  // kHostAllGather the (epoch, R) agreement runs first, as in Dispatch.
  // Moves E x R rows each way like any step (no host sync under kDevice;
  // capturable, like Dispatch).
  // Errors: kFailedPrecondition (a dispatched step in flight, no geometry
  // committed), kAborted (kHostAllGather: ranks disagree on (epoch, R)),
  // collective and CUDA errors. Not thread-safe.
  absl::Status RefuseStep();

  // RefuseCombine()
  //
  // In place of the Combine this rank's caller could not make because its
  // arguments failed the checks (issue 30 item 1): enqueues on stream() the
  // combine's transfers as the peers make them (E x R rows, whatever the
  // expert output region holds), the step header among them with T =
  // kRefusedCombineTokens. Every rank's combine reduction reads the headers
  // first and writes no output row of that step; each peer records the
  // refusal, so its next CheckStep is kAborted "rank r refused its combine
  // of the step at epoch e ..." and the group stays usable; this rank's
  // CheckStep reports nothing for it. The step is then over here (a second
  // Combine is kFailedPrecondition). No host sync; capturable.
  // Errors: kFailedPrecondition (no dispatched step: no peer waits on this
  // rank's combine), collective and CUDA errors. Not thread-safe.
  absl::Status RefuseCombine();

  // Where Forward / Dispatch agree on (epoch, R) from now on (see above): an
  // engine's in-process calls use kDevice, so that they only enqueue and can
  // be captured; the Forward RPC keeps kHostAllGather.
  void set_geometry_check(GeometryCheck check) { options_.geometry_check = check; }
  GeometryCheck geometry_check() const { return options_.geometry_check; }
  // The receive region of the last Dispatch: [E, R, DispatchRowBytes(H, K)]
  // device bytes (kernels/dispatch_pack.cuh), valid until the next Dispatch.
  // With fp8_e4m3 dispatch these are the dequantized bf16 rows (the
  // dispatch_dequant region), not the fp8 wire rows.
  const uint8_t* received_rows() const { return recv_; }
  // The expert compute's output region [E, R, H] bf16 (what Combine sends).
  uint16_t* expert_output() const { return combine_send_; }

  // Captures one step at R = `bucket` into a CUDA graph held by this
  // dispatcher, reading inputs from and writing output to the given device
  // buffers (each with room for `bucket` rows). Collective (every rank
  // captures the same bucket; checked on the host first: kAborted).
  // Errors: kInvalidArgument (bucket < 1 or > N, null pointers, experts),
  // kFailedPrecondition (SwiGLU experts: not capturable, see above),
  // kAborted, CUDA/NCCL errors.
  absl::Status CaptureForward(int64_t bucket, const uint16_t* hidden, const int32_t* topk_ids,
                              const float* topk_weights, const DeviceExpertSet& experts,
                              uint16_t* output);
  // Replays the graph of `bucket` with T = num_tokens rows at `epoch`.
  // Errors: kNotFound (no graph for bucket), kInvalidArgument (T outside
  // [0, bucket]), CUDA errors. Asynchronous: see CheckReplay().
  absl::Status ReplayForward(int64_t bucket, int64_t epoch, int64_t num_tokens);
  // Waits for the stream and reports the device-side (epoch, R) check of the
  // replays since the last call: kAborted naming the first disagreeing rank.
  absl::Status CheckReplay();

  // The sync point of the device-side geometry check: waits for the stream
  // (StreamCollective::Synchronize, with the group's deadline) and reports the
  // first (epoch, R) disagreement or peer's refusal recorded by any step
  // (eager kDevice or replayed) since the last call, then clears it. Errors:
  // kAborted naming the rank and its (epoch, R); when R differed, the step's
  // NCCL transfers had mismatched sizes, so the communicator is aborted too
  // (later calls kFailedPrecondition; form a new group). kAborted "rank r
  // refused its dispatch of the step at epoch e (its arguments failed that
  // rank's checks; its call returned the error); the step wrote no output
  // here (its received rows lack that rank's); the group is still usable"
  // when a peer's
  // RefuseStep met this rank's step (the communicator stays usable; issue
  // 30 item 1), "rank r refused its combine ..." for a peer's
  // RefuseCombine; a rank's own refusal is not reported. kInvalidArgument for
  // an expert id out of range (kernels/expert_id_error.h). Collective
  // errors as Synchronize.
  absl::Status CheckStep() override;

  // After a completed Forward: the receive region copied to the host (sync);
  // with fp8_e4m3 the dequantized rows (received_rows()).
  absl::StatusOr<ReceivedRowsForTest> CopyReceivedForTest();

 private:
  GpuEpDispatcher(StreamCollective* collective, int64_t capacity)
      : collective_(collective), control_(collective), geometry_(collective->rank(), capacity) {}
  absl::Status EnqueueDispatch(int64_t r, const uint16_t* hidden, const int32_t* topk_ids,
                               const float* topk_weights);
  absl::Status EnqueueCombine(int64_t r, uint16_t* output, const uint16_t* shared_out = nullptr,
                              const uint16_t* expert_out = nullptr);
  absl::Status CheckForwardArgs(const char* call, int64_t num_tokens, const void* hidden,
                                const void* topk_ids, const void* topk_weights) const;
  // `refused`: the header tells the peers this rank refused the step
  // (LaunchWriteStepHeader; RefuseStep).
  absl::Status AgreeAndWriteHeader(int64_t num_tokens, bool refused = false);
  // kHostAllGather: AgreeAndWriteHeader; kDevice: WriteHeader only.
  absl::Status BeginStep(int64_t num_tokens, bool refused = false);
  absl::Status CheckExperts(const DeviceExpertSet& experts) const;
  absl::Status WriteHeader(int64_t epoch, int64_t r, int64_t num_tokens,
                           HeaderRefusal sent = HeaderRefusal::kNone);

  StreamCollective* collective_ = nullptr;
  StagedControlCollective control_;  // host agreements over collective_
  core::GeometryState geometry_;
  GpuWorkspaceLayout layout_;
  GpuEpDispatcherOptions options_;
  int ep_size_ = 0;
  int rank_ = 0;
  int64_t capacity_ = 0;
  int64_t hidden_ = 0;
  int top_k_ = 0;
  int64_t row_bytes_ = 0;  // wire row (DispatchRowBytes or Fp8DispatchRowBytes)
  core::DispatchDType dtype_ = core::DispatchDType::kBF16;
  // This rank's distinct slot experts under the installed table, ascending
  // (core::DistinctSlotExperts; any set): what the expert set must hold.
  std::vector<int> local_experts_;

  char* base_ = nullptr;  // the one allocation
  void* tail_ = nullptr;  // the caller's region at its end
  uint8_t* send_ = nullptr;
  uint8_t* recv_ = nullptr;       // the bf16 rows the experts read
  uint8_t* wire_recv_ = nullptr;  // the exchange's receive side (recv_ unless fp8)
  uint16_t* combine_send_ = nullptr;
  uint16_t* combine_recv_ = nullptr;
  int32_t* token_slot_ = nullptr;
  int32_t* send_counts_ = nullptr;
  int64_t* header_ = nullptr;    // {epoch, R, T}
  int64_t* gathered_ = nullptr;  // [E, 3]
  StepHeaderError* error_ = nullptr;
  int64_t* header_replicas_ = nullptr;  // [E, 3]
  std::unique_ptr<ExpertCompute> expert_compute_;
  std::vector<int64_t> counts_;         // [E], reused for the all-to-all byte counts
  std::vector<int64_t> header_counts_;  // [E], 24 bytes each (the header exchange)
  std::vector<int64_t> count_bytes_;    // [E], 4 bytes each (the send-count exchange)
  std::map<int64_t, cudaGraphExec_t> graphs_;
  // DESIGN §15: the device table (in the one allocation) and its identity.
  int32_t* replica_offsets_ = nullptr;           // [num_experts + 1]
  int32_t* replica_ranks_ = nullptr;             // [ep_size * slot budget]
  unsigned long long* expert_tokens_ = nullptr;  // [num_experts]
  int64_t placement_offset_ = 0;
  int64_t placement_bytes_ = 0;
  int max_slots_ = 0;  // ep_size * slot budget
  uint64_t placement_fingerprint_ = 0;
  int64_t counted_steps_ = 0;
};

}  // namespace moe_ep::kernels
