#pragma once

// The one-sided GPU data plane of one rank (DESIGN §13, issue 15 item 2):
// the semantics of kernels::GpuEpDispatcher (DESIGN §6-§7), with dispatch
// and combine as kernels that store straight into the peers' windows
// (kernels/onesided/peer_window.h) instead of NCCL calls. Kernels and the
// protocol: kernels/onesided/onesided_kernels.cuh.
//
// Per step on the SM path: dispatch = 1 kernel for R <= 512 and E <= 8
// (route fused in), else 2;
// expert compute (kernels/expert_compute.h) on the window's received rows,
// except for identity experts, which the combine kernel applies as it pushes
// (the expert kernel's arithmetic); combine = 1 kernel (push, flag exchange,
// reduction with combine_reduce.cuh's arithmetic), so with identity experts
// the output is bit-identical to GpuEpDispatcher's.
// The copy-engine path (options.path, issue 15 item 3;
// kernels/onesided/onesided_bulk.h) moves the bulk rows with
// cudaMemcpy(2D)Async instead of SM stores: dispatch = route kernel, one
// copy per destination, send kernel (ids, flags); identity experts = one
// kernel into the expert output; combine = one copy per source, combine
// kernel (flags, reduction). Its outputs equal the SM path's bit for bit.
// An engine's Dispatch (with `unpack`) and RefuseStep take the SM path at
// any R. last_path() says which path the last step took.
// (epoch, R) agreement rides in the dispatch flags, always on the device: a
// disagreement makes the step write no output row, and CheckStep() reports
// it (kAborted, naming the rank). A peer whose flag does not arrive within
// options.timeout makes CheckStep() return kDeadlineExceeded naming it; the
// dispatcher is then broken (later calls kFailedPrecondition: make new
// windows and a new dispatcher, and capture graphs again).
// The step allocates nothing, never syncs the host, and is capturable; T
// travels as a kernel argument (replayed graphs get it by a kernel-node
// parameter update, so a graph captured at bucket R replays any T <= R).
// Buffers: the window (the provider's), one cudaMalloc of local state and
// the expert output, and the expert scratch, all in Create.
// Ranks as threads share one CUDA context: a device-wide sync in one rank
// (cudaMalloc, cudaFree, cudaDeviceSynchronize, and CUDA's lazy loading of a
// kernel's module on its first launch) waits for a peer's kernel that may be
// spinning for this rank, so it stalls both until the timeout. Create
// pre-loads this plane's kernels; callers allocate before the first step
// and load other kernels (SwiGLU expert GEMMs) once before ranks step
// together (a world-1 step, or CUDA_MODULE_LOADING=EAGER).
// Not thread-safe (one thread per rank). Source: DESIGN §6, §7, §13; issue 15.

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/ep_contract.h"
#include "core/step_dispatcher.h"
#include "kernels/device_experts.h"
#include "kernels/engine_stream_order.h"
#include "kernels/expert_compute.h"
#include "kernels/gpu_ep_dispatcher.h"
#include "kernels/onesided/onesided_bulk.h"
#include "kernels/onesided/onesided_kernels.cuh"
#include "kernels/onesided/peer_window.h"

namespace moe_ep::kernels::onesided {

struct OneSidedDispatcherOptions {
  core::EpDispatcherOptions dispatcher;  // ep_size, N, H (multiple of 8), K, bf16, experts
  int64_t max_intermediate = 0;          // I of the largest SwiGLU layer (0: identity only)
  ExpertGemm expert_gemm = ExpertGemm::kGroupedDevice;
  // Blocks (one per SM at most) of each communication kernel: the SM budget
  // that lets ranks sharing a GPU, and expert GEMMs, run beside it. The
  // kernels' blocks wait on their peers' flags, so every rank's blocks must
  // be resident at once: ranks sharing one GPU need ranks x sm_budget <=
  // its multiprocessors (a block each), else their steps time out.
  int sm_budget = 16;
  // Bound of every wait on a peer's flag (DEADLINE_EXCEEDED after it).
  absl::Duration timeout = absl::Seconds(10);
  // Which path moves the rows (onesided_bulk.h): kAuto takes the copy engine
  // for R >= ce_min_tokens (bf16 dispatch only; fp8 always takes the SM
  // path; an engine's Dispatch with `unpack` and RefuseStep take the SM
  // path at any R). Every rank must use the same choice (the paths
  // interoperate per source, a refusal on the SM path among peers on the
  // copy engine included, but the same choice keeps the figures per R
  // alike). Default
  // kSm: on one H200 (bench/results/onesided-ce/README.md) the ce step lost
  // at every R measured (1-4096 tokens, EP 1 and 2); only its combine phase
  // won at EP 1 from R 1024 (80 vs 101 us at 4096), so kAuto's default
  // threshold is 4096, where the ce combine also won eager at EP 2.
  OsPathChoice path = OsPathChoice::kSm;
  int64_t ce_min_tokens = kDefaultCeMinTokens;
  static constexpr int64_t kDefaultCeMinTokens = 4096;
  // The windows hold receive buffers (receive_buffers(); WindowBytes with
  // receive_buffers true). Every rank the same.
  bool receive_buffers = false;
};

// An engine's dispatch buffers inside this rank's window
// (OneSidedDispatcher::receive_buffers): [E, rows, H] bf16, [E, rows, K]
// int32 and [E, rows, K] fp32 device memory, rows = N, valid while the
// windows live (the workspace).
struct OsReceiveBuffers {
  uint16_t* hidden = nullptr;
  int32_t* topk_ids = nullptr;
  float* topk_weights = nullptr;
  int64_t rows = 0;
};

class OneSidedDispatcher final : public core::StepDispatcher {
 public:
  // H % 8 (16-byte row stores); the rest as the NCCL GPU plane, fp8_e4m3
  // dispatch included (the send kernel quantizes; Dispatch then dequantizes
  // the received rows into local bf16 rows that the experts read).
  static constexpr core::BackendLimits kLimits = {
      "one-sided data plane", kMaxEpSize, kMaxTopK, 8,
      core::DispatchDTypeBit(core::DispatchDType::kBF16) |
          core::DispatchDTypeBit(core::DispatchDType::kFP8E4M3)};

  // Bytes of every rank's window for these options (OsWindowLayout), with
  // receive buffers when `receive_buffers`.
  // Errors: kInvalidArgument as core::ValidateEpOptions with kLimits, for a
  // group of options.workspace.ep_size ranks.
  static absl::StatusOr<int64_t> WindowBytes(const core::EpDispatcherOptions& options,
                                             bool receive_buffers = false);

  // `windows` must outlive the dispatcher; its size() is ep_size and its
  // bytes() equal WindowBytes(options.dispatcher, options.receive_buffers)
  // (every rank creates its
  // dispatcher with the same options). Errors: kInvalidArgument (validation,
  // sm_budget < 1 or over the device's multiprocessors, timeout <= 0,
  // window size), kResourceExhausted (more than
  // memory_cap_bytes when > 0: both numbers; cudaMalloc).
  static absl::StatusOr<std::unique_ptr<OneSidedDispatcher>> Create(
      PeerWindows* windows, const OneSidedDispatcherOptions& options, int64_t memory_cap_bytes);
  ~OneSidedDispatcher() override;
  OneSidedDispatcher(const OneSidedDispatcher&) = delete;
  OneSidedDispatcher& operator=(const OneSidedDispatcher&) = delete;

  // The dispatcher's own stream (owned, non-blocking), which every step
  // outside an engine call is enqueued on. It is first made to wait for
  // the last engine call's work on the engine's stream (EngineStreamOrder::
  // Settle), so work the caller enqueues on it follows that call.
  cudaStream_t stream();
  // An engine's call (server/onesided_engine_calls.cc; issue 30 item 3):
  // between BeginEngineCall and EndEngineCall, Dispatch, CombineFrom and
  // Combine enqueue on `caller`'s stream (returned: the stream to enqueue
  // the call's own kernels on too), ordered after this dispatcher's earlier
  // work, with no fork and join per call (kernels/engine_stream_order.h).
  // End the call on error too. Errors: kFailedPrecondition (a call open),
  // kInternal (CUDA).
  absl::StatusOr<cudaStream_t> BeginEngineCall(cudaStream_t caller);
  absl::Status EndEngineCall();
  // Device bytes this rank holds: window + local state + expert scratch.
  int64_t allocated_bytes() const override;
  // The path options.path, ce_min_tokens and the dtype give a step of R
  // rows (an engine's Dispatch and RefuseStep take the SM path whatever).
  OsPath PathFor(int64_t r) const;
  // The path of the last dispatch begun (eager or captured); kSm before any.
  OsPath last_path() const { return step_path_; }
  // The last step's counts on the device, [E] int32 each: tokens this rank
  // sent to each rank, and rows each source rank sent here. Written by the
  // dispatch on stream(); read them after it (a copy on stream()). What the
  // worker service's step counters come from.
  const int32_t* send_counts() const { return local_.send_counts; }
  const int32_t* recv_counts() const { return local_.recv_counts; }
  // Whether a Dispatch with `unpack` at the committed R writes this rank's
  // own rows straight into the engine's buffers (OsDispatchParams::
  // direct_unpack: the fused SM path with bf16 rows, the buffers fitting
  // OsDirectUnpackFits, MOE_EP_ONESIDED_DIRECT_UNPACK not 0). Not thread-safe
  // against CommitGeometry.
  bool UnpacksDirectly(const UnpackReceivedParams& unpack) const {
    return direct_unpack_ && FusesUnpack(&unpack, geometry_.runtime_max_tokens_per_rank()) &&
           OsDirectUnpackFits(unpack);
  }
  // What an engine's in-process calls read and fill (server/onesided_engine_calls.cc,
  // DESIGN §14), valid on stream() after a Dispatch: the received rows
  // [E, R, 2H + 8K] as kernels/dispatch_pack.cuh packs them (bf16 hidden,
  // int32 ids, fp32 weights; dequantized with fp8_e4m3 dispatch), the rows
  // expert compute reads; and the expert output [E, R, H] bf16 (row j of
  // source s at s * R + j) that Combine sends back when no identity experts
  // were applied. An engine's dispatch with the direct unpack (Dispatch)
  // leaves this rank's own slab of the received rows unwritten: its rows go
  // to the engine's buffers only.
  const uint8_t* received_rows() const { return BfRows(); }
  // The receive buffers of this rank's window (options.receive_buffers;
  // all null without). A Dispatch whose `unpack` names them (hidden, ids,
  // weights, rows = N) on the direct path (UnpacksDirectly, R <=
  // kOsFusedMaxTokens) has the peers store their rows into them in place
  // (OsDispatchParams::peer_direct): slots [R, N) are then not written.
  // Every rank of a step must choose them alike: a peer that dispatched
  // into its own buffers and one that used the receive buffers see
  // kAborted "receive buffers" at CheckStep, and the step wrote no output.
  // Elsewhere (a larger R, fp8 rows) they are ordinary buffers.
  OsReceiveBuffers receive_buffers() const;
  uint16_t* expert_output() const { return expert_out_; }

  // As GpuEpDispatcher::CommitGeometry (core::GeometryState::Commit).
  absl::Status CommitGeometry(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                              int64_t local_tokens) override;
  int64_t epoch() const { return geometry_.epoch(); }
  int64_t runtime_max_tokens_per_rank() const { return geometry_.runtime_max_tokens_per_rank(); }
  // A step is dispatched and not yet combined (or refused): the peers'
  // combine waits for this rank's (RefuseCombine has something to refuse).
  bool in_step() const { return geometry_.in_step(); }

  // One MoE layer, as GpuEpDispatcher::Forward, enqueued on stream() with no
  // host agreement (the flags carry it: see CheckStep). Errors:
  // kFailedPrecondition (no geometry, mid-step, broken), kInvalidArgument
  // (T outside [0, R], null pointers with T > 0, experts not this rank's:
  // see below), kInternal (CUDA).
  // The experts: hidden H and at least one slot, every slot id among this
  // rank's ids [first, first + L) of the contiguous placement of
  // options.dispatcher.num_experts (a subset: a caller that numbers slots
  // in its own id space, server/onesided_route_map.h, may leave ids unused;
  // a choice of an id no slot answers to contributes zero).
  absl::Status Forward(const uint16_t* hidden, const int32_t* topk_ids, const float* topk_weights,
                       int64_t num_tokens, const DeviceExpertSet& experts, uint16_t* output);
  // The phases, as GpuEpDispatcher's (same sequence errors).
  // `zero`: device arrays the dispatch's send kernel zeroes (an engine's
  // count outputs, for an unpack with counts_zeroed after it). `unpack`
  // (an engine's dispatch; recv = received_rows()): the received rows are
  // also unpacked into the engine's buffers, inside the send kernel on the
  // fused SM path with bf16 rows (one launch: OsDispatchParams::
  // fuse_unpack; MOE_EP_ONESIDED_FUSED_UNPACK=0 turns it off), else by
  // LaunchUnpackReceived after it; the slots past each source's count are
  // written as padding (UnpackReceivedParams::recv_counts: the window keeps
  // an earlier step's rows there; the unpack's recv_counts is set to this
  // dispatcher's, whatever the caller passed). On the fused path a rank's own rows go
  // from its inputs to the engine's buffers directly (OsDispatchParams::
  // direct_unpack; MOE_EP_ONESIDED_DIRECT_UNPACK=0 turns it off). With
  // `unpack` the step takes the SM path at any R (the engine's buffers hold
  // each source's rows packed; the copy-engine path's slot of a token is its
  // index). Errors of CheckUnpackReceived as well.
  absl::Status Dispatch(const uint16_t* hidden, const int32_t* topk_ids, const float* topk_weights,
                        int64_t num_tokens, const OsZeroCounts& zero = {},
                        const UnpackReceivedParams* unpack = nullptr);
  // In place of a Dispatch this rank's caller could not make (its
  // arguments failed the checks; issue 30 item 1): a dispatch of no rows
  // whose flags say "refused" (OsDispatchParams::refused) and the combine
  // after it, so the peers' kernels finish at once without output instead
  // of waiting out the timeout; each peer's next CheckStep is kAborted
  // naming this rank, this rank's reports nothing (its caller has the
  // error). The step is then over here (no Combine follows); the peers'
  // Combine of it completes. On the SM path at any R (no row moves).
  // Errors: Dispatch's sequence errors, kInternal.
  absl::Status RefuseStep();
  absl::Status ComputeExperts(const DeviceExpertSet& experts);
  absl::Status Combine(uint16_t* output, const uint16_t* shared_out = nullptr);
  // Combine whose expert outputs are the caller's `expert_out` [E, rows, H]
  // bf16 (rows >= R; slab s's first R rows are sent back), as an engine's
  // combine passes them (server/onesided_engine_calls.cc). The SM path's
  // kernel reads them in place (no host call and no device copy into
  // expert_output() first: issue 30 item 3); an address not 16-byte
  // aligned, or a Dispatch without `unpack` on the copy-engine path, packs
  // them into expert_output() first.
  // Errors: Combine's, and kInvalidArgument (rows < R, null with R > 0).
  absl::Status CombineFrom(const uint16_t* expert_out, int64_t rows, uint16_t* output);
  // In place of a Combine this rank's caller could not make (its arguments
  // failed the checks; issue 30 item 1): the dispatched step's combine with
  // no rows and flags marked refused (OsCombineParams::refused), so the
  // peers' combine ends at once without output instead of waiting out the
  // timeout; each peer's next CheckStep is kAborted naming this rank, this
  // rank's reports nothing. The step is then over on every rank. Errors:
  // Combine's sequence errors (no dispatched step: nothing to refuse).
  absl::Status RefuseCombine();

  // Captures one whole step at R = bucket (a local operation: no peer takes
  // part; a peer that captured another bucket shows up as an R mismatch at
  // replay). On the copy-engine path (PathFor(bucket)) every replay copies
  // `bucket` rows of `hidden`, which must hold that many rows (rows past T
  // reach no expert: their ids are the padding ids). Errors:
  // kInvalidArgument (bucket outside [1, N], null pointers, experts),
  // kFailedPrecondition (broken, mid-step, SwiGLU with kCublasHostCounts),
  // kInternal (CUDA).
  absl::Status CaptureForward(int64_t bucket, const uint16_t* hidden, const int32_t* topk_ids,
                              const float* topk_weights, const DeviceExpertSet& experts,
                              uint16_t* output);
  // Replays the graph of `bucket` with T = num_tokens at `epoch` (one
  // kernel-node parameter update, one graph launch). Errors: kNotFound (no
  // graph: capture again, e.g. after a new group), kInvalidArgument (T
  // outside [0, bucket]), kFailedPrecondition (broken), kInternal.
  absl::Status ReplayForward(int64_t bucket, int64_t epoch, int64_t num_tokens);

  // Waits for stream() and reports the first failure the kernels recorded
  // since the last call, then clears it: kAborted "geometry mismatch: rank
  // ..." (the step wrote no output), kDeadlineExceeded naming the rank whose
  // flag never came, the phase and the step (the dispatcher is then broken;
  // a dispatch-phase deadline wrote no output row, a combine-phase one may
  // have written some).
  absl::Status CheckStep() override;
  // core::GeometryState::CheckStep: a committed geometry and 0 <= T <= R
  // (kFailedPrecondition, kInvalidArgument naming T). No device work: the
  // engine's dispatch checks T with it before it enqueues (a T out of range
  // is refused like the other argument errors; issue 30 item 1).
  absl::Status CheckStep(const char* call, int64_t num_tokens) const {
    return geometry_.CheckStep(call, num_tokens);
  }

  // After a completed step: the received rows [E, R, ...] of this rank's
  // window and the per-source counts, copied to the host (sync; tests).
  absl::StatusOr<ReceivedRowsForTest> CopyReceivedForTest();
  absl::StatusOr<std::vector<int32_t>> ReceivedCountsForTest();

 private:
  struct Graph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaGraphNode_t first = nullptr;  // the dispatch's first kernel
    cudaKernelNodeParams first_params{};
    OsDispatchParams dispatch;  // its parameters at capture
  };
  OneSidedDispatcher(PeerWindows* windows, int64_t capacity)
      : windows_(windows), geometry_(windows->rank(), capacity) {}
  absl::Status Usable() const;
  absl::Status CheckArgs(const char* call, int64_t num_tokens, const void* hidden,
                         const void* topk_ids, const void* topk_weights) const;
  absl::Status CheckExperts(const DeviceExpertSet& experts) const;
  OsDispatchParams DispatchParams(const OsStepArgs& step, const uint16_t* hidden,
                                  const int32_t* topk_ids, const float* topk_weights) const;
  // Whether a dispatch at R = r unpacks `unpack` in its send kernel.
  bool FusesUnpack(const UnpackReceivedParams* unpack, int64_t r) const;
  absl::Status EnqueueDispatch(const OsStepArgs& step, const uint16_t* hidden,
                               const int32_t* topk_ids, const float* topk_weights,
                               const OsZeroCounts& zero = {},
                               const UnpackReceivedParams* unpack = nullptr);
  // The dispatch of p (its path in p.ce); the copy-engine path copies
  // `copy_rows` hidden rows (T eager, the bucket in a capture).
  absl::Status EnqueueDispatchParams(const OsDispatchParams& p, int64_t copy_rows);
  // fp8: the dequantizing pass of the R-row step after its dispatch kernels.
  absl::Status EnqueueDequantize(int64_t r);
  // The bf16 rows the experts read: the window's dispatch_recv, or rows_.
  const uint8_t* BfRows() const;
  // The stream the enqueue helpers use: the open engine call's, else own.
  cudaStream_t Launch() const { return order_->launch(); }
  // Own-stream entry points: the own stream first waits for the last
  // engine call. SettleOwn refuses inside an open engine call;
  // SettleUnlessOpen (the phases an engine call runs) leaves it alone.
  absl::Status SettleOwn();
  absl::Status SettleUnlessOpen();
  absl::Status EnqueueExperts(int64_t r, const DeviceExpertSet& experts);
  // `source` (null: expert_output()) holds the expert outputs with
  // `source_rows` rows per source slab.
  absl::Status EnqueueCombine(int64_t r, uint16_t* output, const uint16_t* shared_out,
                              const uint16_t* source = nullptr, int64_t source_rows = 0,
                              bool refused = false);

  PeerWindows* windows_;
  core::GeometryState geometry_;
  OneSidedDispatcherOptions options_;
  OsWindowOffsets off_;
  OsPeerTable peers_{};
  OsLocalState local_;
  int ep_size_ = 0;
  int rank_ = 0;
  bool fuse_unpack_ = true;  // Dispatch's `unpack` in the send kernel where the path allows
  // The fused unpack writes this rank's own rows straight into the engine's
  // buffers (OsDispatchParams::direct_unpack; MOE_EP_ONESIDED_DIRECT_UNPACK=0:
  // false).
  bool direct_unpack_ = true;
  bool push_own_ = false;  // OsCombineParams::push_own (MOE_EP_ONESIDED_PUSH_OWN=1: true)
  int device_ = 0;
  int64_t capacity_ = 0;
  int64_t hidden_ = 0;
  int top_k_ = 0;
  int first_expert_ = 0;
  int num_local_experts_ = 0;
  int64_t local_bytes_ = 0;
  int sm_count_ = 1;  // the device's multiprocessors (identity rows' grid)
  // The path of the step being enqueued and combined, chosen as its
  // dispatch begins: PathFor(R), or the SM path for an engine's dispatch
  // (Dispatch with `unpack`) and a refusal.
  OsPath step_path_ = OsPath::kSm;
  char* local_base_ = nullptr;
  uint16_t* expert_out_ = nullptr;  // [E, N, H]
  bool fp8_ = false;                // fp8_e4m3 dispatch
  uint8_t* rows_ = nullptr;         // fp8: dequantized rows [E, N, 2H + 8K] (local)
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<EngineStreamOrder> order_;  // stream_ and the engine's streams
  std::unique_ptr<ExpertCompute> expert_compute_;
  absl::Status broken_;
  bool identity_pending_ = false;  // the next combine applies identity experts
  // The identity experts of that combine: their device slot ids and count.
  const int32_t* identity_slot_ids_ = nullptr;
  int identity_slots_ = 0;
  std::map<int64_t, Graph> graphs_;
};

}  // namespace moe_ep::kernels::onesided
