#include "core/ep_dispatcher.h"

// The CPU (Gloo) data plane of core/ep_dispatcher.h.
//
// Memory: one 128-byte-aligned block of AllocatedWorkspace::total_bytes from
// CpuWorkspaceLayout::For (DESIGN §5); the four payload regions are its
// typed fields. Their use on this two-sided path, with E = ep_size,
// N = capacity_tokens, R = runtime_max_tokens_per_rank, c[s][d] = tokens rank s
// sends to rank d, K = top_k, H = hidden (even, so every int32/fp32 part below
// stays 4-byte aligned):
//
//   dispatch send  [E, N, dispatch_bytes] bytes. Per-destination blocks packed
//                  back to back in destination order (Collective::AllToAllV
//                  takes packed blocks); block d holds c[me][d] tokens in slot
//                  order as struct-of-arrays:
//                    hidden [c, H] bf16 | ids [c, K] int32 | weights [c, K] fp32
//                  i.e. c * dispatch_bytes bytes (dispatch_bytes = 2H + 8K).
//                  With fp8_e4m3 dispatch the hidden part of a token is
//                  H e4m3 codes then H/128 fp32 scales (core/fp8_e4m3.h,
//                  quantized here in the pack), so a token's hidden part is
//                  H + H/32 bytes and dispatch_bytes = H + H/32 + 8K.
//   dispatch recv  [E, N, dispatch_bytes] bytes. The packed blocks arrive back
//                  to back and are then moved in place (sources in descending
//                  order, which never overwrites an unmoved block) to one row
//                  of N * dispatch_bytes bytes per source s:
//                    hidden [N, H] bf16 | ids [N, K] int32 | weights [N, K] fp32
//                  Slots 0..c[s][me]-1 are source s's tokens in increasing
//                  source-token order; slots [c, R) are padding, sanitized to
//                  zero hidden, the invalid id and zero weight (DESIGN §7).
//   dispatch dequant (fp8_e4m3 only) [E, N, H] bf16: the dequantizing pass
//                  after the exchange writes each received token's
//                  dispatched row here (core::fp8::DequantizeRow); the
//                  expert compute, ReceivedHidden and engines read it, as
//                  they read the bf16 hidden part of dispatch recv otherwise.
//   combine send   [E, N, 2H] bytes: expert outputs (bf16) of the received
//                  rows, packed back to back in source order (row j of source s
//                  at sum_{t<s} c[t][me] + j).
//   combine recv   [E, N, 2H] bytes: results back from each destination d,
//                  packed in destination order; row c of block d is slot c.
// Metadata regions of the layout are part of the allocation; the per-step
// counts themselves are small members sized once in Create. Expert compute
// widens received rows to fp32 in chunks of up to kExpertChunkRows rows, with
// scratch sized once in Create (not part of the workspace figure).
//
// Collective calls per step: one all-gather of (epoch, R, local error code,
// send_counts[E]) — the agreement check and the count matrix in one round —
// then one all-to-all for dispatch and one for combine. A rank whose own input
// is invalid still joins the all-gather (so peers fail fast with kAborted
// instead of timing out) and then returns its kInvalidArgument; no payload
// moves. A token travels with its full K ids and weights as given, invalid
// ones included (they select no expert anywhere; core/moe_reference.h does
// the same, so received rows compare exactly).

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/expert_source.h"
#include "core/fp8_e4m3.h"
#include "core/geometry.h"
#include "core/routing.h"
#include "core/status_macros.h"
#include "core/stop_check.h"

namespace moe_ep::core {
namespace {

constexpr int64_t kExpertChunkRows = 512;
constexpr int kAgreeHeader = 3;  // epoch, R, local error code

struct AlignedFree {
  void operator()(std::byte* p) const { std::free(p); }
};

int64_t ElapsedUs(absl::Time start) { return absl::ToInt64Microseconds(absl::Now() - start); }

}  // namespace

struct EpDispatcher::Impl {
  ControlCollective* collective = nullptr;
  EpDispatcherOptions options;
  std::shared_ptr<const PlacementTable> table_ptr;  // installed placement (DESIGN §15)
  const PlacementTable* table = nullptr;            // table_ptr.get()
  std::vector<int> local_experts;                   // DistinctSlotExperts(table, rank)
  std::vector<int64_t> expert_tokens;  // [num_experts] load counters since the last reset
  int64_t counted_steps = 0;
  int rank = 0;
  int ep_size = 0;
  int64_t capacity = 0;  // N
  int64_t hidden = 0;    // H
  int top_k = 0;         // K
  int64_t dispatch_bytes = 0;
  int64_t combine_bytes = 0;
  bool fp8 = false;          // dtype fp8_e4m3
  int64_t hidden_bytes = 0;  // a token's hidden part: 2H (bf16) or H + H/32 (fp8_e4m3)

  CpuWorkspaceLayout layout;
  std::unique_ptr<std::byte, AlignedFree> memory;
  std::byte* dispatch_send = nullptr;
  std::byte* dispatch_recv = nullptr;
  std::byte* combine_send = nullptr;
  std::byte* combine_recv = nullptr;
  bf16_t* dispatch_dequant = nullptr;  // fp8_e4m3: [E, N, H]

  // Geometry and step phase (the contract's).
  GeometryState geometry;

  // Per-step state, sized once.
  DispatchRoute route;
  int64_t step_tokens = 0;
  int64_t step_r = 0;
  std::vector<int64_t> agree_send;      // [3 + E]
  std::vector<int64_t> agree_all;       // [E, 3 + E]
  std::vector<int64_t> recv_counts;     // [E] rows received from each source
  std::vector<int64_t> recv_row_off;    // [E] packed row offset of each source
  std::vector<int64_t> send_row_off;    // [E] packed row offset of each destination
  std::vector<int64_t> a2a_send_bytes;  // [E]
  std::vector<int64_t> a2a_recv_bytes;  // [E]
  std::vector<float> x_scratch;         // [chunk, H]
  std::vector<float> y_scratch;         // [chunk, H]
  std::vector<int32_t> ids_scratch;     // [chunk, K]
  std::vector<float> w_scratch;         // [chunk, K]
  std::vector<float> acc;               // [H]
  StepStats stats;

  Impl(std::shared_ptr<const PlacementTable> t, int rank, int64_t capacity)
      : table_ptr(std::move(t)), table(table_ptr.get()), geometry(rank, capacity) {}
  int64_t epoch() const { return geometry.epoch(); }
  int64_t runtime_max() const { return geometry.runtime_max_tokens_per_rank(); }

  int64_t RowBytes() const { return capacity * dispatch_bytes; }
  // The dispatched bf16 rows of source s, [N, H]: the hidden part of its
  // receive row (bf16) or its dequantized rows (fp8_e4m3).
  bf16_t* RecvHidden(int s) const {
    if (fp8) return dispatch_dequant + s * capacity * hidden;
    return reinterpret_cast<bf16_t*>(dispatch_recv + s * RowBytes());
  }
  // fp8_e4m3: token j's codes [H] and then its scales [H / 128].
  std::byte* RecvQuantized(int s, int64_t j) const {
    return dispatch_recv + s * RowBytes() + j * hidden_bytes;
  }
  int32_t* RecvIds(int s) const {
    return reinterpret_cast<int32_t*>(dispatch_recv + s * RowBytes() + capacity * hidden_bytes);
  }
  float* RecvWeights(int s) const {
    return reinterpret_cast<float*>(dispatch_recv + s * RowBytes() +
                                    capacity * (hidden_bytes + 4 * top_k));
  }

  absl::Status ValidateInput(absl::Span<const bf16_t> hidden_in, absl::Span<const int32_t> topk_ids,
                             absl::Span<const float> topk_weights, int64_t num_tokens) const;
  absl::Status Agree(absl::Status local_error);
  absl::Status DispatchImpl(absl::Span<const bf16_t> hidden_in, absl::Span<const int32_t> topk_ids,
                            absl::Span<const float> topk_weights, int64_t num_tokens,
                            absl::Status local_error);
  absl::Status ValidateExperts(const ExpertSet& experts) const;
  absl::Status ComputeExpertsImpl(const ExpertSet& experts, const StopCheck& stop = nullptr);
  absl::Status CombineImpl(absl::Span<bf16_t> output, absl::Span<const bf16_t> shared_out);
};

EpDispatcher::EpDispatcher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EpDispatcher::~EpDispatcher() = default;

absl::StatusOr<std::unique_ptr<EpDispatcher>> EpDispatcher::Create(
    ControlCollective* collective, const EpDispatcherOptions& options, int64_t memory_cap_bytes) {
  if (collective == nullptr) return absl::InvalidArgumentError("collective: must not be null");
  const WorkspaceSpec& spec = options.workspace;
  RETURN_IF_ERROR(ValidateEpOptions(options, collective->size(), kCpuLimits));
  ASSIGN_OR_RETURN(CpuWorkspaceLayout layout, CpuWorkspaceLayout::For(spec));
  ASSIGN_OR_RETURN(int64_t dispatch_bytes,
                   DispatchBytesPerToken(spec.dtype, spec.hidden, spec.top_k));
  ASSIGN_OR_RETURN(PlacementTable table,
                   PlacementTable::Contiguous(options.num_experts, spec.ep_size));
  if (memory_cap_bytes > 0 && layout.total_bytes > memory_cap_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("workspace: ", layout.total_bytes,
                                                     " bytes needed, memory cap is ",
                                                     memory_cap_bytes, " bytes"));
  }

  auto impl = std::make_unique<Impl>(std::make_shared<const PlacementTable>(std::move(table)),
                                     collective->rank(), spec.capacity_tokens);
  impl->local_experts = DistinctSlotExperts(*impl->table, collective->rank());
  impl->expert_tokens.assign(options.num_experts, 0);
  impl->collective = collective;
  impl->options = options;
  impl->rank = collective->rank();
  impl->ep_size = spec.ep_size;
  impl->capacity = spec.capacity_tokens;
  impl->hidden = spec.hidden;
  impl->top_k = spec.top_k;
  impl->dispatch_bytes = dispatch_bytes;
  impl->combine_bytes = CombineBytesPerToken(spec.hidden);
  impl->fp8 = spec.dtype == DispatchDType::kFP8E4M3;
  impl->hidden_bytes = impl->fp8 ? fp8::QuantizedHiddenBytes(spec.hidden) : 2 * spec.hidden;

  const int64_t slab = static_cast<int64_t>(spec.ep_size) * spec.capacity_tokens;
  const int64_t alloc_bytes = std::max<int64_t>(AlignTo128(layout.total_bytes), 128);
  std::byte* block = static_cast<std::byte*>(std::aligned_alloc(128, alloc_bytes));
  if (block == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("workspace: cannot allocate ", layout.total_bytes, " bytes of host memory"));
  }
  impl->memory.reset(block);
  impl->dispatch_send = layout.dispatch_send.At<std::byte>(block);
  impl->dispatch_recv = layout.dispatch_recv.At<std::byte>(block);
  impl->combine_send = layout.combine_send.At<std::byte>(block);
  impl->combine_recv = layout.combine_recv.At<std::byte>(block);
  impl->dispatch_dequant = layout.dispatch_dequant.At<bf16_t>(block);
  impl->layout = layout;

  const int e = spec.ep_size;
  impl->agree_send.assign(kAgreeHeader + e, 0);
  impl->agree_all.assign(static_cast<size_t>(e) * (kAgreeHeader + e), 0);
  impl->recv_counts.assign(e, 0);
  impl->recv_row_off.assign(e, 0);
  impl->send_row_off.assign(e, 0);
  impl->a2a_send_bytes.assign(e, 0);
  impl->a2a_recv_bytes.assign(e, 0);
  const int64_t chunk = std::min<int64_t>(slab, kExpertChunkRows);
  impl->x_scratch.assign(chunk * spec.hidden, 0.0f);
  impl->y_scratch.assign(chunk * spec.hidden, 0.0f);
  impl->ids_scratch.assign(chunk * spec.top_k, 0);
  impl->w_scratch.assign(chunk * spec.top_k, 0.0f);
  impl->acc.assign(spec.hidden, 0.0f);
  // Every slot of every source row starts sanitized.
  for (int s = 0; s < e; ++s) {
    std::memset(impl->RecvHidden(s), 0, spec.capacity_tokens * 2 * spec.hidden);
    std::fill_n(impl->RecvIds(s), spec.capacity_tokens * spec.top_k, options.invalid_expert_id);
    std::fill_n(impl->RecvWeights(s), spec.capacity_tokens * spec.top_k, 0.0f);
  }
  return std::unique_ptr<EpDispatcher>(new EpDispatcher(std::move(impl)));
}

absl::Status EpDispatcher::SetPlacement(std::shared_ptr<const PlacementTable> table) {
  if (table == nullptr) return absl::InvalidArgumentError("SetPlacement: table must not be null");
  Impl& m = *impl_;
  if (m.geometry.in_step()) {
    return absl::FailedPreconditionError(
        "SetPlacement: a step is in flight on this rank; install a placement table between steps");
  }
  if (table.get() == m.table) return absl::OkStatus();
  RETURN_IF_ERROR(ValidatePlacement(*table, m.options));
  m.local_experts = DistinctSlotExperts(*table, m.rank);
  m.table_ptr = std::move(table);
  m.table = m.table_ptr.get();
  return absl::OkStatus();
}

const std::shared_ptr<const PlacementTable>& EpDispatcher::placement() const {
  return impl_->table_ptr;
}

ExpertLoadCounts EpDispatcher::ReadExpertLoad(bool reset) {
  Impl& m = *impl_;
  ExpertLoadCounts out{m.expert_tokens, m.counted_steps};
  if (reset) {
    std::fill(m.expert_tokens.begin(), m.expert_tokens.end(), 0);
    m.counted_steps = 0;
  }
  return out;
}

int64_t EpDispatcher::allocated_bytes() const { return impl_->layout.total_bytes; }
const CpuWorkspaceLayout& EpDispatcher::layout() const { return impl_->layout; }
int64_t EpDispatcher::epoch() const { return impl_->epoch(); }
int64_t EpDispatcher::runtime_max_tokens_per_rank() const { return impl_->runtime_max(); }
const std::vector<int64_t>& EpDispatcher::received_counts() const { return impl_->recv_counts; }
const StepStats& EpDispatcher::last_step() const { return impl_->stats; }

absl::Span<const bf16_t> EpDispatcher::ReceivedHidden(int src) const {
  if (src < 0 || src >= impl_->ep_size) return {};
  return absl::MakeConstSpan(impl_->RecvHidden(src), impl_->step_r * impl_->hidden);
}
absl::Span<const int32_t> EpDispatcher::ReceivedIds(int src) const {
  if (src < 0 || src >= impl_->ep_size) return {};
  return absl::MakeConstSpan(impl_->RecvIds(src), impl_->step_r * impl_->top_k);
}
absl::Span<const float> EpDispatcher::ReceivedWeights(int src) const {
  if (src < 0 || src >= impl_->ep_size) return {};
  return absl::MakeConstSpan(impl_->RecvWeights(src), impl_->step_r * impl_->top_k);
}

absl::StatusOr<std::vector<int64_t>> EpDispatcher::SyncTokenCounts(int64_t local_tokens) {
  // A negative count still joins the all-gather so peers fail fast too.
  ASSIGN_OR_RETURN(std::vector<int64_t> counts, AllGatherInt64(*impl_->collective, local_tokens));
  RETURN_IF_ERROR(ValidateLocalTokens(local_tokens, impl_->rank));
  for (int r = 0; r < static_cast<int>(counts.size()); ++r) {
    if (counts[r] < 0) {
      return absl::AbortedError(
          absl::StrCat("rank ", r, " reported an invalid local token count ", counts[r]));
    }
  }
  return counts;
}

absl::Status EpDispatcher::CommitGeometry(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                                          int64_t local_tokens) {
  return impl_->geometry.Commit(epoch, runtime_max_tokens_per_rank, local_tokens);
}

absl::Status EpDispatcher::Impl::ValidateInput(absl::Span<const bf16_t> hidden_in,
                                               absl::Span<const int32_t> topk_ids,
                                               absl::Span<const float> topk_weights,
                                               int64_t num_tokens) const {
  RETURN_IF_ERROR(geometry.CheckStep("Dispatch", num_tokens));
  if (static_cast<int64_t>(hidden_in.size()) != num_tokens * hidden) {
    return absl::InvalidArgumentError(absl::StrCat("hidden: expected [", num_tokens, ", ", hidden,
                                                   "] = ", num_tokens * hidden, " elements, got ",
                                                   hidden_in.size()));
  }
  if (static_cast<int64_t>(topk_ids.size()) != num_tokens * top_k) {
    return absl::InvalidArgumentError(absl::StrCat("topk_ids: expected [", num_tokens, ", ", top_k,
                                                   "] = ", num_tokens * top_k, " elements, got ",
                                                   topk_ids.size()));
  }
  if (static_cast<int64_t>(topk_weights.size()) != num_tokens * top_k) {
    return absl::InvalidArgumentError(absl::StrCat("topk_weights: expected [", num_tokens, ", ",
                                                   top_k, "] = ", num_tokens * top_k,
                                                   " elements, got ", topk_weights.size()));
  }
  return absl::OkStatus();
}

absl::Status EpDispatcher::Impl::Agree(absl::Status local_error) {
  const int64_t epoch = this->epoch();
  const int64_t runtime_max = this->runtime_max();
  agree_send[0] = epoch;
  agree_send[1] = runtime_max;
  agree_send[2] = local_error.ok() ? 0 : static_cast<int64_t>(local_error.code());
  for (int d = 0; d < ep_size; ++d) {
    agree_send[kAgreeHeader + d] = local_error.ok() ? route.send_counts[d] : 0;
  }
  RETURN_IF_ERROR(collective->AllGather(agree_send.data(),
                                        static_cast<int64_t>(agree_send.size() * sizeof(int64_t)),
                                        agree_all.data()));
  if (!local_error.ok()) return local_error;
  const int stride = kAgreeHeader + ep_size;
  // A masked rank takes no part (its rows are zeros: core/masked_collective.h).
  for (int r = 0; r < ep_size; ++r) {
    if (!collective->IsLive(r)) continue;
    const int64_t code = agree_all[r * stride + 2];
    if (code != 0) {
      return absl::AbortedError(
          absl::StrCat("rank ", r, " rejected its input for this step (",
                       absl::StatusCodeToString(static_cast<absl::StatusCode>(code)),
                       "); no payload was exchanged (this rank is rank ", rank, ")"));
    }
  }
  for (int r = 0; r < ep_size; ++r) {
    if (!collective->IsLive(r)) continue;
    const int64_t e = agree_all[r * stride];
    const int64_t rr = agree_all[r * stride + 1];
    if (e != epoch || rr != runtime_max) {
      return absl::AbortedError(absl::StrCat("geometry mismatch: rank ", r, " has (epoch ", e,
                                             ", R ", rr, "), this rank (rank ", rank,
                                             ") has (epoch ", epoch, ", R ", runtime_max,
                                             "); commit the same geometry on every rank"));
    }
  }
  for (int s = 0; s < ep_size; ++s) {
    const int64_t c = agree_all[s * stride + kAgreeHeader + rank];
    if (c < 0 || c > runtime_max) {
      return absl::InternalError(absl::StrCat("rank ", s, " sends ", c,
                                              " tokens to this rank (rank ", rank,
                                              "), outside [0, R = ", runtime_max, "]"));
    }
  }
  return absl::OkStatus();
}

absl::Status EpDispatcher::Impl::DispatchImpl(absl::Span<const bf16_t> hidden_in,
                                              absl::Span<const int32_t> topk_ids,
                                              absl::Span<const float> topk_weights,
                                              int64_t num_tokens, absl::Status local_error) {
  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(geometry.BeginDispatch("Dispatch"));
  if (local_error.ok()) local_error = ValidateInput(hidden_in, topk_ids, topk_weights, num_tokens);
  // DESIGN §7: only the configured invalid id is padding; any other id
  // outside [0, num_experts) fails the step on every rank (peers kAborted).
  if (local_error.ok()) {
    local_error = ValidateExpertIds(topk_ids.first(num_tokens * top_k), top_k, options.num_experts,
                                    options.invalid_expert_id);
  }
  if (local_error.ok()) {
    auto route_or = ComputeDispatchRoute(topk_ids, num_tokens, top_k, *table, rank);
    if (route_or.ok()) {
      route = std::move(route_or).value();
    } else {
      local_error = route_or.status();
    }
  }
  RETURN_IF_ERROR(Agree(local_error));

  // Counts and packed offsets.
  const int64_t runtime_max = this->runtime_max();
  const int stride = kAgreeHeader + ep_size;
  int64_t send_rows = 0;
  int64_t recv_rows = 0;
  for (int p = 0; p < ep_size; ++p) {
    recv_counts[p] = agree_all[p * stride + kAgreeHeader + rank];
    send_row_off[p] = send_rows;
    recv_row_off[p] = recv_rows;
    send_rows += route.send_counts[p];
    recv_rows += recv_counts[p];
    a2a_send_bytes[p] = route.send_counts[p] * dispatch_bytes;
    a2a_recv_bytes[p] = recv_counts[p] * dispatch_bytes;
  }

  // Pack: block d = hidden [c, H] | ids [c, K] | weights [c, K], the hidden
  // part quantized for fp8_e4m3 (codes [H] | scales [H / 128] a token).
  const int32_t invalid = options.invalid_expert_id;
  const size_t hidden_row = hidden_bytes;
  const size_t k_row = top_k * sizeof(int32_t);
  for (int d = 0; d < ep_size; ++d) {
    const int64_t c = route.send_counts[d];
    std::byte* block = dispatch_send + send_row_off[d] * dispatch_bytes;
    std::byte* ids_part = block + c * hidden_row;
    std::byte* w_part = ids_part + c * k_row;
    for (int64_t slot = 0; slot < c; ++slot) {
      const int64_t t = route.tokens_for_rank[d][slot];
      std::byte* hidden_out = block + slot * hidden_row;
      if (fp8) {
        auto* codes = reinterpret_cast<uint8_t*>(hidden_out);
        fp8::QuantizeRow(hidden_in.data() + t * hidden, hidden, codes,
                         reinterpret_cast<float*>(codes + hidden));
      } else {
        std::memcpy(hidden_out, hidden_in.data() + t * hidden, hidden_row);
      }
      int32_t* ids_out = reinterpret_cast<int32_t*>(ids_part + slot * k_row);
      for (int k = 0; k < top_k; ++k) {
        ids_out[k] = PayloadExpertId(*table, rank, t, topk_ids[t * top_k + k], d, invalid);
      }
      std::memcpy(w_part + slot * k_row, topk_weights.data() + t * top_k, k_row);
    }
  }
  absl::Status exchanged =
      collective->AllToAllV(dispatch_send, a2a_send_bytes, dispatch_recv, a2a_recv_bytes);
  if (!exchanged.ok()) return exchanged;

  // Move each source's packed block to its row, descending (safe in place:
  // block s starts at <= s * R * dispatch_bytes <= its row start), then split
  // it into the [N, H] | [N, K] | [N, K] row layout and sanitize padding.
  for (int s = ep_size - 1; s >= 0; --s) {
    const int64_t c = recv_counts[s];
    std::byte* row = dispatch_recv + s * RowBytes();
    std::byte* packed = dispatch_recv + recv_row_off[s] * dispatch_bytes;
    if (c > 0 && row != packed) std::memmove(row, packed, c * dispatch_bytes);
    if (c > 0) {
      std::memmove(RecvWeights(s), row + c * (hidden_row + k_row), c * k_row);
      std::memmove(RecvIds(s), row + c * hidden_row, c * k_row);
    }
    // The dequantizing pass: the dispatched bf16 rows the experts read.
    if (fp8) {
      for (int64_t j = 0; j < c; ++j) {
        const auto* codes = reinterpret_cast<const uint8_t*>(RecvQuantized(s, j));
        fp8::DequantizeRow(codes, reinterpret_cast<const float*>(codes + hidden), hidden,
                           RecvHidden(s) + j * hidden);
      }
    }
    // Rows [c, max(R, previous R)) are reset so no stale token survives.
    const int64_t end = std::max(runtime_max, step_r);
    if (end > c) {
      std::memset(RecvHidden(s) + c * hidden, 0, (end - c) * hidden * sizeof(bf16_t));
      std::fill(RecvIds(s) + c * top_k, RecvIds(s) + end * top_k, invalid);
      std::fill(RecvWeights(s) + c * top_k, RecvWeights(s) + end * top_k, 0.0f);
    }
  }

  CountExpertTokens(topk_ids.first(num_tokens * top_k), options.num_experts,
                    absl::MakeSpan(expert_tokens));
  ++counted_steps;
  step_tokens = num_tokens;
  step_r = runtime_max;
  geometry.MarkDispatched();
  stats = StepStats{};
  stats.runtime_max_tokens_per_rank = runtime_max;
  stats.tokens_sent = static_cast<int64_t>(route.dest_rank.size());
  stats.tokens_received = recv_rows;
  for (int p = 0; p < ep_size; ++p) {
    if (p != rank) stats.bytes_sent_remote += a2a_send_bytes[p];
  }
  // Under a rank mask: this rank's choices of experts with no live replica
  // (they were sent nowhere and contribute zero; DESIGN §15).
  if (table->masked()) {
    for (int64_t i = 0; i < num_tokens * top_k; ++i) {
      const int32_t id = topk_ids[i];
      if (id < 0 || id >= options.num_experts || !table->LiveReplicas(id).empty()) continue;
      ++stats.lost_choices;
      if (!std::binary_search(stats.lost_experts.begin(), stats.lost_experts.end(), id)) {
        stats.lost_experts.insert(
            std::upper_bound(stats.lost_experts.begin(), stats.lost_experts.end(), id), id);
      }
    }
  }
  stats.dispatch_us = ElapsedUs(start);
  return absl::OkStatus();
}

absl::Status EpDispatcher::Impl::ValidateExperts(const ExpertSet& experts) const {
  if (experts.hidden() != hidden) {
    return absl::InvalidArgumentError(absl::StrCat("experts: hidden ", experts.hidden(),
                                                   " differs from the workspace hidden ", hidden));
  }
  if (experts.expert_ids() != local_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts: rank ", rank, " owns experts ", DescribeExpertIds(local_experts),
                     " under the placement table (fingerprint ", absl::Hex(table->Fingerprint()),
                     "), got ", DescribeExpertIds(experts.expert_ids())));
  }
  return absl::OkStatus();
}

absl::Status EpDispatcher::Impl::ComputeExpertsImpl(const ExpertSet& experts,
                                                    const StopCheck& stop) {
  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(geometry.RequireDispatched("ComputeExperts"));
  RETURN_IF_ERROR(ValidateExperts(experts));
  // Gather received rows of all sources, in source then slot order (= the
  // packed combine-send order), in chunks; one ComputeWeightedSum per chunk.
  const int64_t chunk = static_cast<int64_t>(x_scratch.size()) / hidden;
  bf16_t* out_rows = reinterpret_cast<bf16_t*>(combine_send);
  int64_t out_row = 0;
  int s = 0;
  int64_t slot = 0;
  while (true) {
    while (s < ep_size && slot >= recv_counts[s]) {
      ++s;
      slot = 0;
    }
    if (s >= ep_size) break;
    // A stop leaves the step dispatched, not computed: Combine refuses it.
    if (ShouldStop(stop)) {
      int64_t received = 0;
      for (int64_t c : recv_counts) received += c;
      return LocalStop(
          absl::StrCat("expert compute: after ", out_row, " of ", received, " received rows"));
    }
    int64_t rows = 0;
    while (rows < chunk && s < ep_size) {
      const int64_t take = std::min(chunk - rows, recv_counts[s] - slot);
      const bf16_t* src = RecvHidden(s) + slot * hidden;
      for (int64_t i = 0; i < take * hidden; ++i) {
        x_scratch[rows * hidden + i] = Bf16ToFloat(src[i]);
      }
      std::copy_n(RecvIds(s) + slot * top_k, take * top_k, ids_scratch.begin() + rows * top_k);
      std::copy_n(RecvWeights(s) + slot * top_k, take * top_k, w_scratch.begin() + rows * top_k);
      rows += take;
      slot += take;
      while (s < ep_size && slot >= recv_counts[s]) {
        ++s;
        slot = 0;
      }
    }
    RETURN_IF_ERROR(experts.ComputeWeightedSum(x_scratch, ids_scratch, w_scratch, rows, top_k,
                                               absl::MakeSpan(y_scratch), stop));
    for (int64_t i = 0; i < rows * hidden; ++i) {
      out_rows[out_row * hidden + i] = FloatToBf16(y_scratch[i]);
    }
    out_row += rows;
  }
  geometry.MarkComputed();
  stats.expert_us = ElapsedUs(start);
  return absl::OkStatus();
}

absl::Status EpDispatcher::Impl::CombineImpl(absl::Span<bf16_t> output,
                                             absl::Span<const bf16_t> shared_out) {
  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(geometry.RequireComputed("Combine"));
  if (static_cast<int64_t>(output.size()) != step_tokens * hidden) {
    return absl::InvalidArgumentError(absl::StrCat("output: expected [", step_tokens, ", ", hidden,
                                                   "] = ", step_tokens * hidden, " elements, got ",
                                                   output.size()));
  }
  if (!shared_out.empty() && shared_out.size() != output.size()) {
    return absl::InvalidArgumentError(absl::StrCat("shared expert output: expected [", step_tokens,
                                                   ", ", hidden, "] or none, got ",
                                                   shared_out.size(), " elements"));
  }
  // Send row block s (rows received from s) back to s; receive from each
  // destination d the rows this rank sent it.
  int64_t combine_remote = 0;
  for (int p = 0; p < ep_size; ++p) {
    a2a_send_bytes[p] = recv_counts[p] * combine_bytes;
    a2a_recv_bytes[p] = route.send_counts[p] * combine_bytes;
    if (p != rank) combine_remote += a2a_send_bytes[p];
  }
  // Whatever happens now, this step is over: a failed exchange broke the group.
  geometry.MarkIdle();
  RETURN_IF_ERROR(
      collective->AllToAllV(combine_send, a2a_send_bytes, combine_recv, a2a_recv_bytes));
  const bf16_t* back = reinterpret_cast<const bf16_t*>(combine_recv);
  for (int64_t t = 0; t < step_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t e = route.token_offsets[t]; e < route.token_offsets[t + 1]; ++e) {
      const int d = route.dest_rank[e];
      const bf16_t* row = back + (send_row_off[d] + route.dest_slot[e]) * hidden;
      for (int64_t h = 0; h < hidden; ++h) acc[h] += Bf16ToFloat(row[h]);
    }
    // The shared expert's term, after the ranks' (core/shared_expert.h).
    if (!shared_out.empty()) {
      const bf16_t* shared_row = shared_out.data() + t * hidden;
      for (int64_t h = 0; h < hidden; ++h) acc[h] += Bf16ToFloat(shared_row[h]);
    }
    bf16_t* out = output.data() + t * hidden;
    for (int64_t h = 0; h < hidden; ++h) out[h] = FloatToBf16(acc[h]);
  }
  stats.bytes_sent_remote += combine_remote;
  stats.combine_us = ElapsedUs(start);
  return absl::OkStatus();
}

absl::Status EpDispatcher::Dispatch(absl::Span<const bf16_t> hidden,
                                    absl::Span<const int32_t> topk_ids,
                                    absl::Span<const float> topk_weights, int64_t num_tokens,
                                    absl::Status local_error) {
  return impl_->DispatchImpl(hidden, topk_ids, topk_weights, num_tokens, std::move(local_error));
}

bool EpDispatcher::step_in_flight() const { return impl_->geometry.in_step(); }

absl::Status EpDispatcher::ReleaseStep() {
  RETURN_IF_ERROR(impl_->geometry.RequireDispatched("ReleaseStep"));
  impl_->geometry.MarkIdle();
  return absl::OkStatus();
}

absl::Status EpDispatcher::ComputeExperts(const ExpertSet& experts) {
  return impl_->ComputeExpertsImpl(experts);
}

absl::Status EpDispatcher::Combine(absl::Span<bf16_t> output, absl::Span<const bf16_t> shared_out) {
  return impl_->CombineImpl(output, shared_out);
}

absl::Status EpDispatcher::SetExpertOutputs(absl::Span<const bf16_t> expert_out, int64_t rows) {
  Impl& m = *impl_;
  RETURN_IF_ERROR(m.geometry.RequireDispatched("SetExpertOutputs"));
  if (rows < m.step_r) {
    return absl::InvalidArgumentError(absl::StrCat("expert outputs: rows per source ", rows,
                                                   " is below the step's R = ", m.step_r));
  }
  const int64_t expected = static_cast<int64_t>(m.ep_size) * rows * m.hidden;
  if (static_cast<int64_t>(expert_out.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("expert outputs: expected [", m.ep_size, ", ",
                                                   rows, ", ", m.hidden, "] = ", expected,
                                                   " elements, got ", expert_out.size()));
  }
  // Packed in source order, as ComputeExperts writes them.
  bf16_t* out_rows = reinterpret_cast<bf16_t*>(m.combine_send);
  for (int s = 0; s < m.ep_size; ++s) {
    std::copy_n(expert_out.data() + s * rows * m.hidden, m.recv_counts[s] * m.hidden,
                out_rows + m.recv_row_off[s] * m.hidden);
  }
  m.geometry.MarkComputed();
  return absl::OkStatus();
}

absl::Status EpDispatcher::Forward(absl::Span<const bf16_t> hidden,
                                   absl::Span<const int32_t> topk_ids,
                                   absl::Span<const float> topk_weights, int64_t num_tokens,
                                   const ExpertSet& experts, absl::Span<bf16_t> output,
                                   absl::Span<const bf16_t> shared_out,
                                   const std::function<absl::Status()>& before_combine,
                                   const StopCheck& stop) {
  Impl& m = *impl_;
  RETURN_IF_ERROR(m.geometry.BeginDispatch("Forward"));
  // Problems with this rank's experts or output are input errors: they are
  // reported through the agreement round so that peers abort instead of
  // waiting for this rank.
  absl::Status local = m.ValidateExperts(experts);
  if (local.ok() && num_tokens >= 0 &&
      static_cast<int64_t>(output.size()) != num_tokens * m.hidden) {
    local = absl::InvalidArgumentError(absl::StrCat("output: expected [", num_tokens, ", ",
                                                    m.hidden, "] = ", num_tokens * m.hidden,
                                                    " elements, got ", output.size()));
  }
  if (local.ok() && !shared_out.empty() && shared_out.size() != output.size()) {
    local =
        absl::InvalidArgumentError(absl::StrCat("shared expert output: expected ", output.size(),
                                                " elements or none, got ", shared_out.size()));
  }
  RETURN_IF_ERROR(m.DispatchImpl(hidden, topk_ids, topk_weights, num_tokens, local));
  absl::Status computed = m.ComputeExpertsImpl(experts, stop);
  // After a local stop the gate still runs: the peers wait in it, and it
  // stops them too (its answer replaces the local stop).
  if ((computed.ok() || IsLocalStop(computed)) && before_combine) {
    absl::Status gate = before_combine();
    if (!gate.ok() || computed.ok()) computed = std::move(gate);
  }
  if (!computed.ok()) {
    m.geometry.MarkIdle();
    return computed;
  }
  return m.CombineImpl(output, shared_out);
}

}  // namespace moe_ep::core
