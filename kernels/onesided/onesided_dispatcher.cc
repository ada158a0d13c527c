#include "kernels/onesided/onesided_dispatcher.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/expert_placement.h"
#include "core/expert_source.h"
#include "core/status_macros.h"
#include "kernels/dispatch_pack.cuh"
#include "kernels/engine_rows.cuh"
#include "kernels/expert_id_error.h"
#include "kernels/fp8_dispatch.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/kernel_preload.h"
#include "kernels/peer_refusal.h"

namespace moe_ep::kernels::onesided {

using internal::CudaStatus;

namespace {

int64_t Align128(int64_t x) { return (x + 127) / 128 * 128; }

}  // namespace

absl::StatusOr<int64_t> OneSidedDispatcher::WindowBytes(const core::EpDispatcherOptions& o,
                                                        bool receive_buffers) {
  RETURN_IF_ERROR(core::ValidateEpOptions(o, o.workspace.ep_size, kLimits));
  const core::WorkspaceSpec& ws = o.workspace;
  return OsWindowLayout(ws.ep_size, ws.capacity_tokens, ws.hidden, ws.top_k,
                        ws.dtype == core::DispatchDType::kFP8E4M3, receive_buffers)
      .total_bytes;
}

absl::StatusOr<std::unique_ptr<OneSidedDispatcher>> OneSidedDispatcher::Create(
    PeerWindows* windows, const OneSidedDispatcherOptions& options, int64_t memory_cap_bytes) {
  if (windows == nullptr) return absl::InvalidArgumentError("windows: must not be null");
  const core::EpDispatcherOptions& o = options.dispatcher;
  const core::WorkspaceSpec& ws = o.workspace;
  RETURN_IF_ERROR(core::ValidateEpOptions(o, windows->size(), kLimits));
  RETURN_IF_ERROR(core::ValidateMaxIntermediate(options.max_intermediate));
  if (options.sm_budget < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("sm_budget: expected >= 1, got %d", options.sm_budget));
  }
  if (options.ce_min_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ce_min_tokens: expected >= 1, got %d", options.ce_min_tokens));
  }
  if (options.path == OsPathChoice::kCopyEngine && ws.dtype != core::DispatchDType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrFormat("path ce: the copy-engine path moves bf16 rows only, dispatch_dtype is %s; "
                        "use path sm or auto",
                        core::DispatchDTypeName(ws.dtype)));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("timeout: expected > 0, got %s", absl::FormatDuration(options.timeout)));
  }
  const bool fp8 = ws.dtype == core::DispatchDType::kFP8E4M3;
  const OsWindowOffsets off = OsWindowLayout(ws.ep_size, ws.capacity_tokens, ws.hidden, ws.top_k,
                                             fp8, options.receive_buffers);
  if (windows->bytes() != off.total_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "peer windows: expected %d bytes per window for these options (WindowBytes), got %d",
        off.total_bytes, windows->bytes()));
  }
  ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                   core::ExpertPlacement::Contiguous(o.num_experts, ws.ep_size));
  std::unique_ptr<OneSidedDispatcher> d(new OneSidedDispatcher(windows, ws.capacity_tokens));
  d->options_ = options;
  d->off_ = off;
  d->ep_size_ = ws.ep_size;
  d->rank_ = windows->rank();
  d->device_ = windows->device();
  d->capacity_ = ws.capacity_tokens;
  d->hidden_ = ws.hidden;
  d->top_k_ = ws.top_k;
  d->first_expert_ = placement.FirstExpert(d->rank_);
  d->num_local_experts_ = placement.NumLocalExperts(d->rank_);
  for (int r = 0; r < ws.ep_size; ++r)
    d->peers_.window[r] = static_cast<uint8_t*>(windows->window(r));

  const int64_t e = ws.ep_size;
  const int64_t n = ws.capacity_tokens;
  // Local state, one allocation: expert output, token slots, counts, header,
  // block counters, error record; each region 128-aligned. The step counter
  // lives in the window.
  const int64_t o_out = 0;
  const int64_t o_slot = Align128(o_out + e * n * ws.hidden * 2);
  const int64_t o_send = Align128(o_slot + n * e * 4);
  const int64_t o_recv = Align128(o_send + e * 4);
  const int64_t o_header = Align128(o_recv + e * 4);
  const int64_t o_done = Align128(o_header + 3 * 8);
  const int64_t o_error = Align128(o_done + 2 * 4 + 8);  // counters, then unpacked
  const int64_t o_rows = Align128(o_error + static_cast<int64_t>(sizeof(OsStepError)));
  const int64_t rows_bytes = fp8 ? e * n * DispatchRowBytes(ws.hidden, ws.top_k) : 0;
  d->local_bytes_ = Align128(o_rows + rows_bytes);
  d->fp8_ = fp8;
  ASSIGN_OR_RETURN(const int64_t scratch,
                   ExpertCompute::ScratchBytes(e * n, ws.top_k, ws.hidden, options.max_intermediate,
                                               d->num_local_experts_));
  const int64_t total = off.total_bytes + d->local_bytes_ + scratch;
  if (memory_cap_bytes > 0 && total > memory_cap_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "one-sided data plane on rank %d needs %d device bytes (window %d, local %d, expert "
        "scratch %d), over the cap of %d",
        d->rank_, total, off.total_bytes, d->local_bytes_, scratch, memory_cap_bytes));
  }
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(d->device_), "cudaSetDevice"));
  RETURN_IF_ERROR(
      CudaStatus(cudaDeviceGetAttribute(&d->sm_count_, cudaDevAttrMultiProcessorCount, d->device_),
                 "cudaDeviceGetAttribute(multiprocessors)"));
  if (options.sm_budget > d->sm_count_) {
    // The communication kernels' blocks wait on each other: all must be
    // resident, one per multiprocessor (and, for ranks sharing this GPU,
    // all of theirs too: the caller's to keep; see sm_budget).
    return absl::InvalidArgumentError(
        absl::StrFormat("sm_budget: expected <= the %d multiprocessors of CUDA device %d, got %d",
                        d->sm_count_, d->device_, options.sm_budget));
  }
  // Every kernel a step may launch, the engine's unpack and the fp8
  // dequantizer included, before any can spin (kernels/kernel_preload.h).
  RETURN_IF_ERROR(PreloadStepKernels());
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&d->stream_, cudaStreamNonBlocking),
                             "cudaStreamCreateWithFlags"));
  RETURN_IF_ERROR(
      CudaStatus(cudaMalloc(&d->local_base_, d->local_bytes_),
                 absl::StrFormat("cudaMalloc(one-sided local state, %d bytes)", d->local_bytes_)));
  // Stream-ordered (never a device-wide sync: ranks sharing the GPU may be
  // mid-step on their own streams).
  RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(d->local_base_, 0, d->local_bytes_, d->stream_),
                             "cudaMemsetAsync(local state)"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(d->stream_), "cudaStreamSynchronize"));
  ASSIGN_OR_RETURN(d->order_, EngineStreamOrder::Create(d->stream_));
  char* b = d->local_base_;
  d->expert_out_ = reinterpret_cast<uint16_t*>(b + o_out);
  d->local_.token_slot = reinterpret_cast<int32_t*>(b + o_slot);
  d->local_.send_counts = reinterpret_cast<int32_t*>(b + o_send);
  d->local_.recv_counts = reinterpret_cast<int32_t*>(b + o_recv);
  d->local_.header = reinterpret_cast<int64_t*>(b + o_header);
  d->local_.seq = reinterpret_cast<uint64_t*>(d->peers_.window[d->rank_] + off.seq);
  d->local_.done = reinterpret_cast<uint32_t*>(b + o_done);
  // An engine's dispatch is unpacked in the send kernel (one launch; the C
  // dispatch's host time 8.84 / 9.07 us against 10.84 / 12.38 with the
  // unpack a kernel of its own: bench/results/engine-host/call7);
  // MOE_EP_ONESIDED_FUSED_UNPACK=0 keeps the separate kernel (an A/B knob).
  const char* fused = std::getenv("MOE_EP_ONESIDED_FUSED_UNPACK");
  d->fuse_unpack_ = fused == nullptr || std::string_view(fused) != "0";
  // A rank's own rows go straight into the engine's buffers (at EP 1 no
  // window rows and no second pass: issue 30's graph dispatch against the
  // bare kernel); MOE_EP_ONESIDED_DIRECT_UNPACK=0 keeps the window path (A/B).
  const char* direct = std::getenv("MOE_EP_ONESIDED_DIRECT_UNPACK");
  d->direct_unpack_ = direct == nullptr || std::string_view(direct) != "0";
  // The combine reads this rank's own rows in place (OsCombineParams::
  // push_own false: EP 1 combine at 128 tokens 7.87 us against 10.69,
  // 4096 128.45 against 137.60, EP 2 threads 267.23 against 309.66,
  // bench/results/engine-host/call8); MOE_EP_ONESIDED_PUSH_OWN=1 pushes
  // them through the window as before (the way back, an A/B knob).
  const char* push_own = std::getenv("MOE_EP_ONESIDED_PUSH_OWN");
  d->push_own_ = push_own != nullptr && std::string_view(push_own) == "1";
  // After the two counters (8-aligned).
  d->local_.unpacked = reinterpret_cast<uint64_t*>(b + o_done + 8);
  d->local_.error = reinterpret_cast<OsStepError*>(b + o_error);
  if (fp8) d->rows_ = reinterpret_cast<uint8_t*>(b + o_rows);
  ASSIGN_OR_RETURN(d->expert_compute_,
                   ExpertCompute::Create(e * n, ws.top_k, ws.hidden, options.max_intermediate,
                                         d->num_local_experts_));
  RETURN_IF_ERROR(d->expert_compute_->set_gemm(options.expert_gemm));
  return d;
}

OneSidedDispatcher::~OneSidedDispatcher() {
  cudaSetDevice(device_);
  for (auto& [bucket, g] : graphs_) {
    cudaGraphExecDestroy(g.exec);
    cudaGraphDestroy(g.graph);
  }
  if (order_ != nullptr) {
    (void)order_->End();
    (void)order_->Settle();  // the engine's last call on its stream too
  }
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  expert_compute_.reset();
  cudaFree(local_base_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

int64_t OneSidedDispatcher::allocated_bytes() const {
  return off_.total_bytes + local_bytes_ + expert_compute_->allocated_bytes();
}

OsPath OneSidedDispatcher::PathFor(int64_t r) const {
  return ChooseOsPath(options_.path, r, options_.ce_min_tokens, fp8_);
}

absl::Status OneSidedDispatcher::Usable() const {
  if (broken_.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "one-sided data plane on rank %d is broken by an earlier error (%s); make new windows "
      "and a new dispatcher",
      rank_, broken_.message()));
}

absl::Status OneSidedDispatcher::CommitGeometry(int64_t epoch, int64_t r, int64_t local_tokens) {
  RETURN_IF_ERROR(Usable());
  return geometry_.Commit(epoch, r, local_tokens);
}

absl::Status OneSidedDispatcher::CheckArgs(const char* call, int64_t num_tokens, const void* hidden,
                                           const void* topk_ids, const void* topk_weights) const {
  RETURN_IF_ERROR(Usable());
  RETURN_IF_ERROR(geometry_.CheckStep(call, num_tokens));
  return core::ValidateStepPointers(call, rank_, num_tokens, hidden, topk_ids, topk_weights);
}

absl::Status OneSidedDispatcher::CheckExperts(const DeviceExpertSet& experts) const {
  const std::vector<int>& ids = experts.slot_ids();
  const int last = first_expert_ + num_local_experts_;
  if (experts.hidden() != hidden_ || ids.empty() || ids.front() < first_expert_ ||
      ids.back() >= last) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "experts on rank %d: expected hidden %d and slot ids among [%d, %d) (at least one), got "
        "hidden %d and %s",
        rank_, hidden_, first_expert_, last, experts.hidden(), core::DescribeExpertIds(ids)));
  }
  return absl::OkStatus();
}

OsDispatchParams OneSidedDispatcher::DispatchParams(const OsStepArgs& step, const uint16_t* hidden,
                                                    const int32_t* topk_ids,
                                                    const float* topk_weights) const {
  OsDispatchParams p;
  p.peers = peers_;
  p.off = off_;
  p.local = local_;
  p.step = step;
  p.hidden = hidden;
  p.topk_ids = topk_ids;
  p.topk_weights = topk_weights;
  p.rank = rank_;
  p.ep_size = ep_size_;
  p.hidden_size = hidden_;
  p.top_k = top_k_;
  p.num_experts = options_.dispatcher.num_experts;
  p.invalid_expert_id = options_.dispatcher.invalid_expert_id;
  p.blocks = options_.sm_budget;
  p.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(options_.timeout));
  p.sys_scope = !windows_->same_device();
  p.fp8 = fp8_;
  p.ce = step_path_ == OsPath::kCopyEngine;
  return p;
}

const uint8_t* OneSidedDispatcher::BfRows() const {
  return fp8_ ? rows_ : peers_.window[rank_] + off_.dispatch_recv;
}

absl::Status OneSidedDispatcher::EnqueueDequantize(int64_t r) {
  if (!fp8_) return absl::OkStatus();
  return LaunchDequantizeDispatchRows(peers_.window[rank_] + off_.dispatch_recv, ep_size_ * r,
                                      hidden_, top_k_, rows_, Launch());
}

absl::Status OneSidedDispatcher::EnqueueDispatchParams(const OsDispatchParams& p,
                                                       int64_t copy_rows) {
  if (!p.ce) {
    RETURN_IF_ERROR(LaunchOsDispatch(p, Launch()));
    return EnqueueDequantize(p.step.r);
  }
  // Route (slots = token index), the copies, then ids + flags (stream order
  // puts the flags after the copies).
  RETURN_IF_ERROR(LaunchOsRoute(p, Launch()));
  RETURN_IF_ERROR(EnqueueOsBulkDispatch(p, copy_rows, Launch()));
  return LaunchOsSend(p, Launch());
}

absl::Status OneSidedDispatcher::EnqueueDispatch(const OsStepArgs& step, const uint16_t* hidden,
                                                 const int32_t* topk_ids, const float* topk_weights,
                                                 const OsZeroCounts& zero,
                                                 const UnpackReceivedParams* unpack) {
  OsDispatchParams p = DispatchParams(step, hidden, topk_ids, topk_weights);
  p.zero = zero;
  if (FusesUnpack(unpack, step.r)) {
    p.fuse_unpack = true;
    p.unpack = *unpack;
    p.direct_unpack = direct_unpack_ && OsDirectUnpackFits(*unpack);
    p.peer_direct =
        p.direct_unpack && OsUnpacksIntoReceiveBuffers(*unpack, peers_.window[rank_], off_);
  }
  return EnqueueDispatchParams(p, std::min(step.t, step.r));
}

OsReceiveBuffers OneSidedDispatcher::receive_buffers() const {
  if (off_.receive_hidden == 0) return {};
  auto* own = static_cast<uint8_t*>(windows_->window(rank_));
  return {reinterpret_cast<uint16_t*>(own + off_.receive_hidden),
          reinterpret_cast<int32_t*>(own + off_.receive_ids),
          reinterpret_cast<float*>(own + off_.receive_weights), off_.receive_rows};
}

bool OneSidedDispatcher::FusesUnpack(const UnpackReceivedParams* unpack, int64_t r) const {
  // The fused SM path with bf16 rows, its counts zeroed by the send kernel
  // (the unpack only adds). An engine's dispatch always takes the SM path.
  return unpack != nullptr && fuse_unpack_ && unpack->counts_zeroed && !fp8_ &&
         OsDispatchFused(r, ep_size_);
}

absl::Status OneSidedDispatcher::EnqueueExperts(int64_t r, const DeviceExpertSet& experts) {
  if (experts.kind() == core::ExpertKind::kIdentity && step_path_ == OsPath::kCopyEngine) {
    // The copy engine moves the expert output: identity rows are written
    // into it first (the arithmetic the SM path applies as it pushes).
    identity_pending_ = false;
    OsIdentityParams ip;
    ip.rows = BfRows();
    ip.out = expert_out_;
    ip.recv_counts = local_.recv_counts;
    ip.ep_size = ep_size_;
    ip.hidden_size = hidden_;
    ip.top_k = top_k_;
    ip.slot_ids = experts.device_slot_ids();
    ip.num_local_experts = experts.num_experts();
    ip.max_tokens = r;
    ip.blocks = 2 * sm_count_;
    return LaunchOsIdentityRows(ip, Launch());
  }
  if (experts.kind() == core::ExpertKind::kIdentity) {
    // The combine kernel applies identity experts to the received rows as it
    // pushes them (the expert kernel's arithmetic): nothing to launch.
    identity_pending_ = true;
    identity_slot_ids_ = experts.device_slot_ids();
    identity_slots_ = experts.num_experts();
    return absl::OkStatus();
  }
  identity_pending_ = false;
  return expert_compute_->Run(BfRows(), ep_size_ * r, experts, expert_out_, Launch());
}

absl::Status OneSidedDispatcher::EnqueueCombine(int64_t r, uint16_t* output,
                                                const uint16_t* shared_out, const uint16_t* source,
                                                int64_t source_rows, bool refused) {
  OsCombineParams p;
  p.peers = peers_;
  p.off = off_;
  p.local = local_;
  p.identity = identity_pending_;
  p.slot_ids = identity_slot_ids_;
  p.num_local_experts = identity_slots_;
  p.expert_out = source != nullptr ? source : expert_out_;
  p.expert_out_rows = source != nullptr ? source_rows : r;
  p.rows = fp8_ ? rows_ : nullptr;
  // T == 0 writes no row; any aligned address stands in for a null output.
  p.output = output ? output : expert_out_;
  p.shared = shared_out;
  p.rank = rank_;
  p.ep_size = ep_size_;
  p.hidden_size = hidden_;
  p.top_k = top_k_;
  p.max_tokens = r;
  p.blocks = options_.sm_budget;
  p.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(options_.timeout));
  p.sys_scope = !windows_->same_device();
  p.ce = step_path_ == OsPath::kCopyEngine;
  p.refused = refused;
  // An output overlapping the expert output it reduces (an engine may
  // combine in place) must not be written while other warps still read this
  // rank's rows from it: those rows then travel through the window, read
  // before the flag round as before.
  const auto at = [](const uint16_t* x) { return reinterpret_cast<uintptr_t>(x); };
  const bool in_place_output =
      output != nullptr && !p.identity &&
      at(output) < at(p.expert_out) + 2 * ep_size_ * p.expert_out_rows * hidden_ &&
      at(p.expert_out) < at(output) + 2 * r * hidden_;
  p.push_own = push_own_ || in_place_output;
  if (p.ce && !refused) {
    p.identity = false;  // EnqueueExperts wrote the identity rows
    RETURN_IF_ERROR(
        EnqueueOsBulkCombine(peers_, off_, rank_, ep_size_, r, hidden_, expert_out_, Launch()));
  }
  identity_pending_ = false;
  return LaunchOsCombine(p, Launch());
}

absl::StatusOr<cudaStream_t> OneSidedDispatcher::BeginEngineCall(cudaStream_t caller) {
  return order_->Begin(caller);
}

absl::Status OneSidedDispatcher::EndEngineCall() { return order_->End(); }

cudaStream_t OneSidedDispatcher::stream() {
  // A failed wait leaves a broken context, which the caller's next CUDA
  // call on the stream reports.
  (void)order_->Settle();
  return stream_;
}

absl::Status OneSidedDispatcher::SettleOwn() {
  if (order_->launch() != stream_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "one-sided dispatcher on rank %d: own-stream work inside an open engine call", rank_));
  }
  return order_->Settle();
}

absl::Status OneSidedDispatcher::SettleUnlessOpen() {
  return order_->launch() == stream_ ? order_->Settle() : absl::OkStatus();
}

absl::Status OneSidedDispatcher::Forward(const uint16_t* hidden, const int32_t* topk_ids,
                                         const float* topk_weights, int64_t num_tokens,
                                         const DeviceExpertSet& experts, uint16_t* output) {
  RETURN_IF_ERROR(geometry_.BeginDispatch("Forward"));
  RETURN_IF_ERROR(SettleUnlessOpen());
  RETURN_IF_ERROR(CheckArgs("Forward", num_tokens, hidden, topk_ids, topk_weights));
  RETURN_IF_ERROR(core::ValidateStepOutput("Forward", rank_, num_tokens, output));
  RETURN_IF_ERROR(CheckExperts(experts));
  const int64_t r = geometry_.runtime_max_tokens_per_rank();
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  step_path_ = PathFor(r);
  RETURN_IF_ERROR(
      EnqueueDispatch({geometry_.epoch(), r, num_tokens}, hidden, topk_ids, topk_weights));
  RETURN_IF_ERROR(EnqueueExperts(r, experts));
  return EnqueueCombine(r, output, nullptr);
}

absl::Status OneSidedDispatcher::Dispatch(const uint16_t* hidden, const int32_t* topk_ids,
                                          const float* topk_weights, int64_t num_tokens,
                                          const OsZeroCounts& zero,
                                          const UnpackReceivedParams* unpack) {
  RETURN_IF_ERROR(geometry_.BeginDispatch("Dispatch"));
  RETURN_IF_ERROR(SettleUnlessOpen());
  RETURN_IF_ERROR(CheckArgs("Dispatch", num_tokens, hidden, topk_ids, topk_weights));
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  // The window keeps an earlier step's rows past this step's counts: the
  // unpack writes padding there (the counts the send kernel records).
  UnpackReceivedParams counted;
  if (unpack != nullptr) {
    RETURN_IF_ERROR(CheckUnpackReceived(*unpack));
    counted = *unpack;
    counted.recv_counts = local_.recv_counts;
    unpack = &counted;
  }
  // The engine's buffers hold each source's rows packed in slot order: the
  // SM path's slots. The copy-engine path's slot of a token is its index at
  // every destination (tokens sent elsewhere would sit below the counts).
  step_path_ = unpack != nullptr ? OsPath::kSm : PathFor(geometry_.runtime_max_tokens_per_rank());
  RETURN_IF_ERROR(
      EnqueueDispatch({geometry_.epoch(), geometry_.runtime_max_tokens_per_rank(), num_tokens},
                      hidden, topk_ids, topk_weights, zero, unpack));
  // Dispatched once the flags are enqueued, whatever follows: the peers'
  // combine now waits for this rank's.
  geometry_.MarkDispatched();
  if (unpack == nullptr || FusesUnpack(unpack, geometry_.runtime_max_tokens_per_rank())) {
    return absl::OkStatus();
  }
  return LaunchUnpackReceived(*unpack, Launch());
}

absl::Status OneSidedDispatcher::RefuseStep() {
  RETURN_IF_ERROR(geometry_.BeginDispatch("Dispatch"));
  RETURN_IF_ERROR(SettleUnlessOpen());
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  const int64_t r = geometry_.runtime_max_tokens_per_rank();
  // No row moves: nothing for the copy engine (the peers' flag rounds are
  // the same on either path).
  step_path_ = OsPath::kSm;
  OsDispatchParams p = DispatchParams({geometry_.epoch(), r, 0}, nullptr, nullptr, nullptr);
  p.refused = true;
  RETURN_IF_ERROR(EnqueueDispatchParams(p, 0));
  // The combine the peers' engines will call after their dispatch: every
  // rank saw the refusal, so it moves no row and writes no output.
  geometry_.MarkIdle();
  return EnqueueCombine(r, nullptr, nullptr);
}

absl::Status OneSidedDispatcher::ComputeExperts(const DeviceExpertSet& experts) {
  RETURN_IF_ERROR(geometry_.RequireDispatched("ComputeExperts"));
  RETURN_IF_ERROR(SettleUnlessOpen());
  RETURN_IF_ERROR(CheckExperts(experts));
  RETURN_IF_ERROR(EnqueueExperts(geometry_.runtime_max_tokens_per_rank(), experts));
  geometry_.MarkComputed();
  return absl::OkStatus();
}

absl::Status OneSidedDispatcher::Combine(uint16_t* output, const uint16_t* shared_out) {
  // As the NCCL plane: combine whenever a step was dispatched, so every
  // rank's flag sequence stays aligned even if its expert compute failed.
  RETURN_IF_ERROR(geometry_.RequireDispatched("Combine"));
  RETURN_IF_ERROR(SettleUnlessOpen());
  geometry_.MarkIdle();
  return EnqueueCombine(geometry_.runtime_max_tokens_per_rank(), output, shared_out);
}

absl::Status OneSidedDispatcher::CombineFrom(const uint16_t* expert_out, int64_t rows,
                                             uint16_t* output) {
  RETURN_IF_ERROR(geometry_.RequireDispatched("Combine"));
  RETURN_IF_ERROR(SettleUnlessOpen());
  const int64_t r = geometry_.runtime_max_tokens_per_rank();
  if (rows < r || (r > 0 && expert_out == nullptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Combine on rank %d: expert outputs of %d rows per source (want >= R = %d, not null)",
        rank_, rows, r));
  }
  const bool in_place = r > 0 && step_path_ == OsPath::kSm && !identity_pending_ &&
                        reinterpret_cast<uintptr_t>(expert_out) % 16 == 0;
  if (r > 0 && !in_place) {
    RETURN_IF_ERROR(
        EnqueueExpertOutputsPack(expert_out, rows, expert_out_, r, hidden_, ep_size_, Launch()));
  }
  geometry_.MarkIdle();
  return in_place ? EnqueueCombine(r, output, nullptr, expert_out, rows)
                  : EnqueueCombine(r, output, nullptr);
}

absl::Status OneSidedDispatcher::RefuseCombine() {
  RETURN_IF_ERROR(geometry_.RequireDispatched("Combine"));
  RETURN_IF_ERROR(SettleUnlessOpen());
  identity_pending_ = false;
  geometry_.MarkIdle();
  return EnqueueCombine(geometry_.runtime_max_tokens_per_rank(), nullptr, nullptr, nullptr, 0,
                        /*refused=*/true);
}

absl::Status OneSidedDispatcher::CaptureForward(int64_t bucket, const uint16_t* hidden,
                                                const int32_t* topk_ids, const float* topk_weights,
                                                const DeviceExpertSet& experts, uint16_t* output) {
  RETURN_IF_ERROR(Usable());
  if (geometry_.in_step()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "CaptureForward on rank %d: a dispatched step is in flight; call Combine first", rank_));
  }
  RETURN_IF_ERROR(
      core::ValidateCaptureArgs(rank_, bucket, capacity_, hidden, topk_ids, topk_weights, output));
  RETURN_IF_ERROR(CheckExperts(experts));
  RETURN_IF_ERROR(CheckCapturable(rank_, experts.kind(), options_.expert_gemm));
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(SettleOwn());
  Graph g;
  step_path_ = PathFor(bucket);
  g.dispatch = DispatchParams({geometry_.epoch(), bucket, bucket}, hidden, topk_ids, topk_weights);
  RETURN_IF_ERROR(CudaStatus(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
                             "cudaStreamBeginCapture"));
  absl::Status captured = EnqueueDispatchParams(g.dispatch, bucket);
  if (captured.ok()) captured = EnqueueExperts(bucket, experts);
  if (captured.ok()) captured = EnqueueCombine(bucket, output, nullptr);
  const cudaError_t end = cudaStreamEndCapture(stream_, &g.graph);
  if (!captured.ok() || end != cudaSuccess) {
    if (g.graph != nullptr) cudaGraphDestroy(g.graph);
    RETURN_IF_ERROR(captured);
    return CudaStatus(end, "cudaStreamEndCapture");
  }
  // The dispatch's first kernel takes the step's (epoch, R, T): find its node
  // so that a replay can update them.
  const void* first = OsFirstDispatchKernel(bucket, ep_size_, hidden_, top_k_, g.dispatch.ce);
  size_t count = 0;
  absl::Status found = CudaStatus(cudaGraphGetNodes(g.graph, nullptr, &count), "cudaGraphGetNodes");
  std::vector<cudaGraphNode_t> nodes(count);
  if (found.ok() && count > 0) {
    found = CudaStatus(cudaGraphGetNodes(g.graph, nodes.data(), &count), "cudaGraphGetNodes");
  }
  for (size_t i = 0; found.ok() && i < count && g.first == nullptr; ++i) {
    cudaGraphNodeType type;
    if (cudaGraphNodeGetType(nodes[i], &type) != cudaSuccess || type != cudaGraphNodeTypeKernel) {
      continue;
    }
    cudaKernelNodeParams kp{};
    if (cudaGraphKernelNodeGetParams(nodes[i], &kp) == cudaSuccess && kp.func == first) {
      g.first = nodes[i];
      g.first_params = kp;
    }
  }
  if (found.ok() && g.first == nullptr) {
    // Where the runtime reports another handle than the kernel's host stub:
    // the capture's one root is the dispatch's first launch.
    size_t roots = 0;
    cudaGraphNode_t root = nullptr;
    cudaGraphNodeType type;
    cudaKernelNodeParams kp{};
    if (cudaGraphGetRootNodes(g.graph, nullptr, &roots) == cudaSuccess && roots == 1 &&
        cudaGraphGetRootNodes(g.graph, &root, &roots) == cudaSuccess &&
        cudaGraphNodeGetType(root, &type) == cudaSuccess && type == cudaGraphNodeTypeKernel &&
        cudaGraphKernelNodeGetParams(root, &kp) == cudaSuccess) {
      g.first = root;
      g.first_params = kp;
    }
  }
  if (found.ok() && g.first == nullptr) {
    found = absl::InternalError(absl::StrFormat(
        "CaptureForward on rank %d: the dispatch kernel node was not found in the graph", rank_));
  }
  if (found.ok()) {
    found = CudaStatus(cudaGraphInstantiate(&g.exec, g.graph, 0), "cudaGraphInstantiate");
  }
  if (!found.ok()) {
    cudaGraphDestroy(g.graph);
    return found;
  }
  auto it = graphs_.find(bucket);
  if (it != graphs_.end()) {
    cudaGraphExecDestroy(it->second.exec);
    cudaGraphDestroy(it->second.graph);
    graphs_.erase(it);
  }
  graphs_.emplace(bucket, g);
  return absl::OkStatus();
}

absl::Status OneSidedDispatcher::ReplayForward(int64_t bucket, int64_t epoch, int64_t num_tokens) {
  RETURN_IF_ERROR(Usable());
  auto it = graphs_.find(bucket);
  if (it == graphs_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "ReplayForward on rank %d: no graph captured for bucket %d; capture it (again)", rank_,
        bucket));
  }
  RETURN_IF_ERROR(core::ValidateReplayTokens(rank_, bucket, num_tokens));
  RETURN_IF_ERROR(SettleOwn());
  Graph& g = it->second;
  OsDispatchParams p = g.dispatch;
  p.step = {epoch, bucket, num_tokens};
  void* args[] = {&p};
  cudaKernelNodeParams kp = g.first_params;
  kp.kernelParams = args;
  kp.extra = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaGraphExecKernelNodeSetParams(g.exec, g.first, &kp),
                             "cudaGraphExecKernelNodeSetParams"));
  return CudaStatus(cudaGraphLaunch(g.exec, stream_), "cudaGraphLaunch");
}

absl::Status OneSidedDispatcher::CheckStep() {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(SettleOwn());
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  OsStepError e;
  RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(&e, local_.error, sizeof(e), cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync(step error record)"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  if (e.kind == kOsNone && e.ids.count == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(local_.error, 0, sizeof(e), stream_),
                             "cudaMemsetAsync(step error record)"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  if (e.kind == kOsNone) {
    // Only this rank's ids were wrong: those choices were masked and every
    // flag was published, so the next step may run.
    return ExpertIdErrorStatus(e.ids, top_k_, options_.dispatcher.num_experts,
                               options_.dispatcher.invalid_expert_id, rank_);
  }
  if (e.kind == kOsMismatch && e.my_r == kOsRefusedR) {
    return absl::OkStatus();  // this rank refused the step: its caller has the error
  }
  if (e.kind == kOsMismatch && e.their_r == kOsRefusedR) {
    const bool combine = e.phase == kOsCombine;
    return PeerRefusalError(e.rank, e.their_epoch,
                            combine ? RefusedPhase::kCombine : RefusedPhase::kDispatch,
                            combine ? "the step wrote no output here (its expert outputs lack "
                                      "that rank's)"
                                    : "the step moved no row here and wrote no output");
  }
  if (e.kind == kOsMismatch && ((e.their_r ^ e.my_r) & kOsPeerDirectR) != 0 &&
      (e.their_r & ~kOsPeerDirectR) == (e.my_r & ~kOsPeerDirectR) && e.their_epoch == e.my_epoch) {
    const bool mine = (e.my_r & kOsPeerDirectR) != 0;
    constexpr const char* kInPlace = "dispatched into the window's receive buffers";
    constexpr const char* kOwn = "dispatched into its own buffers (or off the direct path)";
    return absl::AbortedError(absl::StrFormat(
        "receive buffers mismatch in the dispatch of (epoch %d, R %d): rank %d %s, rank %d %s; in "
        "a step every rank's engine passes the window's receive buffers (moe_ep_receive_buffers) "
        "or none does, under the same MOE_EP_ONESIDED_DIRECT_UNPACK and "
        "MOE_EP_ONESIDED_FUSED_UNPACK; the step wrote no output",
        e.my_epoch, e.my_r & ~kOsPeerDirectR, e.rank, mine ? kOwn : kInPlace, rank_,
        mine ? kInPlace : kOwn));
  }
  // R as published, without the peer-direct bit (a refusal's R is negative).
  auto shown = [](int64_t r) { return r >= 0 ? r & ~kOsPeerDirectR : r; };
  if (e.kind == kOsMismatch) {
    return absl::AbortedError(absl::StrFormat(
        "geometry mismatch: rank %d has (epoch %d, R %d), rank %d has (epoch %d, R %d); the step "
        "wrote no output",
        e.rank, e.their_epoch, shown(e.their_r), rank_, e.my_epoch, shown(e.my_r)));
  }
  broken_ = absl::DeadlineExceededError(absl::StrFormat(
      "one-sided %s of step %d: rank %d waited %s for rank %d's flag, which did not come; %s",
      e.phase == kOsDispatch ? "dispatch" : "combine", e.seq, rank_,
      absl::FormatDuration(options_.timeout), e.rank,
      e.phase == kOsDispatch ? "the step wrote no output"
                             : "the step's output is not valid (rows may be partial)"));
  return broken_;
}

absl::StatusOr<ReceivedRowsForTest> OneSidedDispatcher::CopyReceivedForTest() {
  RETURN_IF_ERROR(SettleOwn());
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  const int64_t r = geometry_.runtime_max_tokens_per_rank();
  const int64_t row_bytes = DispatchRowBytes(hidden_, top_k_);
  std::vector<uint8_t> raw(ep_size_ * r * row_bytes);
  if (!raw.empty()) {
    RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(raw.data(), BfRows(), raw.size(), cudaMemcpyDeviceToHost, stream_),
        "cudaMemcpyAsync(window)"));
    RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  }
  return UnpackReceivedRows(raw.data(), ep_size_ * r, hidden_, top_k_, r);
}

absl::StatusOr<std::vector<int32_t>> OneSidedDispatcher::ReceivedCountsForTest() {
  RETURN_IF_ERROR(SettleOwn());
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  std::vector<int32_t> counts(ep_size_);
  RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(counts.data(), local_.recv_counts, ep_size_ * 4,
                                             cudaMemcpyDeviceToHost, stream_),
                             "cudaMemcpyAsync(recv counts)"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"));
  return counts;
}

}  // namespace moe_ep::kernels::onesided
