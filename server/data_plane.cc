#include "server/data_plane.h"

#include <atomic>
#include <cstring>
#include <exception>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/ep_contract.h"
#include "core/gloo_collective.h"
#include "core/status_macros.h"
#include "server/backend_selection.h"
#include "server/cpu_data_plane.h"
#include "server/device_info.h"
#include "server/gpu_data_plane.h"
#include "server/onesided_data_plane.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {
namespace {

// Mask round `round` of `group` as its rank sees it (server/rank_mask.h):
// the group's Rendezvous addresses, secret, generation, timeout and
// data-plane host, with `live_before` the live ranks before the round.
MaskRound MaskRoundOf(const DataPlaneGroup& group, int round, std::vector<bool> live_before) {
  MaskRound agree;
  agree.addresses = group.rendezvous_addresses;
  agree.secret = group.rendezvous_secret;
  agree.generation = group.generation;
  agree.round = round;
  agree.rank = group.rank;
  agree.live_before = std::move(live_before);
  agree.timeout = group.timeout;
  agree.data_plane_host = group.data_plane_host;
  return agree;
}

}  // namespace

absl::Status CheckExpertSourceForWorkspace(const core::ExpertSource& source,
                                           const core::EpDispatcherOptions& options, int rank,
                                           const core::PlacementTable* table) {
  RETURN_IF_ERROR(core::ValidateExpertSource(source));
  if (source.hidden != options.workspace.hidden) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert source (", source.Describe(), "): hidden: expected the workspace's ",
                     options.workspace.hidden, ", got ", source.hidden));
  }
  if (source.num_routed_experts != options.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert source (", source.Describe(), "): num_routed_experts: expected the workspace's ",
        options.num_experts, ", got ", source.num_routed_experts));
  }
  if (table != nullptr) return core::CheckExpertSlots(source, *table, rank);
  return core::CheckExpertRange(source, rank, options.workspace.ep_size);
}

absl::Status CheckGpuExpertSource(const core::ExpertSource& source) {
  // The step H and I must be multiples of on the GPU, and what Gloo takes:
  // the Hopper fp8 kernels tile K and N by the 128 x 128 scale blocks; the
  // mxfp4 kernels step K by 64 (kernels/mxfp4_grouped_gemm.cuh kMxfp4KStep;
  // gate_up's K is H, down's is I). bf16 and identity experts take any size.
  int64_t step = 0;
  const char* format = "";
  const char* gloo = "";
  switch (source.expert_kind()) {
    case core::ExpertKind::kFp8SwiGlu:
      step = 128;
      format = "fp8";
      gloo = "any size";
      break;
    case core::ExpertKind::kGptOssMxfp4:
      step = 64;
      format = "mxfp4";
      gloo = "any multiple of 32";
      break;
    default:
      return absl::OkStatus();
  }
  if (source.hidden % step == 0 && source.intermediate % step == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("expert source (", source.Describe(), "): ", format,
                   " experts on a GPU plane need hidden and intermediate multiples of ", step,
                   ", got hidden ", source.hidden, ", intermediate ", source.intermediate,
                   " (the gloo plane computes ", gloo, ")"));
}

std::vector<int> RankMaskState::MaskedRanks() const {
  std::vector<int> out;
  for (size_t r = 0; r < live.size(); ++r) {
    if (!live[r]) out.push_back(static_cast<int>(r));
  }
  return out;
}

bool DataPlane::CanMask() const {
  const DataPlaneGroup& g = group();
  return g.world_size > 1 && static_cast<int>(g.rendezvous_addresses.size()) == g.world_size;
}

void DataPlane::BeginMaskRound(int64_t votes) {
  if (!CanMask() || round_.running()) return;
  BeforeMaskRound();
  RankMaskState state = mask();
  round_votes_ = votes;
  MaskRound agree = MaskRoundOf(group(), state.round + 1, std::move(state.live));
  agree.votes = votes;
  round_.Start(std::move(agree));
}

absl::StatusOr<bool> DataPlane::FinishMaskRound(absl::Duration wait) {
  if (!CanMask()) {
    return absl::UnimplementedError(absl::StrCat(
        "rank masks: the ", backend(),
        " data plane cannot go on without a lost rank (it needs more than one rank and "
        "every rank's rendezvous address); join a new generation"));
  }
  BeginMaskRound(round_votes_);
  std::optional<absl::StatusOr<MaskAgreement>> result = round_.Wait(wait);
  if (!result.has_value()) return false;
  if (!result->ok()) return result->status();
  const int64_t votes = (*result)->votes;
  RETURN_IF_ERROR(Adopt(*std::move(*result), mask().round + 1));
  agreed_votes_ = votes;
  return true;
}

absl::Status DataPlane::Readmit(int round, const std::vector<bool>& live_before,
                                const std::vector<bool>& joining) {
  if (!CanMask()) {
    return absl::UnimplementedError(absl::StrCat(
        "Rejoin: the ", backend(),
        " data plane cannot re-admit a rank (it needs every rank's rendezvous address); "
        "join a new generation"));
  }
  if (round_.running()) {
    return absl::FailedPreconditionError(absl::StrCat("Rejoin: rank mask round ", mask().round + 1,
                                                      " is still running on rank ", group().rank,
                                                      "; send the call again"));
  }
  MaskRound agree = MaskRoundOf(group(), round, live_before);
  agree.joining = joining;
  ASSIGN_OR_RETURN(MaskAgreement agreed, AgreeRankMask(agree));
  agreed_votes_ = 0;
  return Adopt(std::move(agreed), round);
}

absl::Status DataPlane::Adopt(MaskAgreement agreed, int round) {
  std::vector<bool> live = agreed.live;
  const int host = agreed.host;
  RETURN_IF_ERROR(UseAgreement(std::move(agreed), round));
  book_.SetLive(live);
  mask_.live = std::move(live);
  mask_.round = round;
  mask_.host = host;
  return absl::OkStatus();
}

std::string PlaneKindName(PlaneKind kind) {
  switch (kind) {
    case PlaneKind::kGloo:
      return "gloo";
    case PlaneKind::kNccl:
      return "nccl";
    case PlaneKind::kOneSided:
      return "one-sided";
  }
  return "unknown";
}

absl::StatusOr<int64_t> DataPlane::LoadSharedExpert(int layer,
                                                    std::optional<core::SharedExpert> shared,
                                                    int64_t memory_cap_bytes) {
  const bool drop = !shared.has_value();
  ASSIGN_OR_RETURN(const int64_t bytes,
                   HoldSharedExpert(layer, std::move(shared),
                                    allocated_bytes() + experts_.TotalBytes(), memory_cap_bytes));
  if (drop) {
    shared_bytes_.erase(layer);
  } else {
    shared_bytes_[layer] = bytes;
  }
  return bytes;
}

int64_t DataPlane::SharedExpertBytes(int layer) const {
  auto it = shared_bytes_.find(layer);
  return it == shared_bytes_.end() ? 0 : it->second;
}

void DataPlane::ForgetExperts() {
  experts_.Clear();
  shared_bytes_.clear();
}

int64_t DataPlane::HeldExpertBytes() const {
  int64_t bytes = experts_.TotalBytes();
  for (const auto& [layer, held] : shared_bytes_) bytes += held;
  return bytes;
}

absl::StatusOr<int64_t> DataPlane::GrownScratchCap(int layer, int64_t intermediate,
                                                   int64_t workspace_intermediate,
                                                   int64_t new_weight_bytes, int64_t other_bytes,
                                                   int64_t memory_cap_bytes) const {
  if (memory_cap_bytes <= 0) return 0;
  const int64_t cap =
      memory_cap_bytes - (HeldExpertBytes() - ExpertBytes(layer)) - new_weight_bytes - other_bytes;
  if (cap <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "LoadExperts: layer ", layer, " (intermediate ", intermediate,
        ") needs more expert scratch than the workspace was allocated with (intermediate ",
        workspace_intermediate, "), and the memory cap of ", memory_cap_bytes,
        " bytes leaves no room; configure the model's moe_intermediate_size before "
        "AllocateWorkspace or raise --memory-cap-bytes"));
  }
  return cap;
}

void DataPlane::SetCall(const CallBound& call) {
  call_ = call;
  collective().SetCallDeadline(CollectiveDeadline(call));
}

absl::StatusOr<std::string> ResolveBenchmarkPlane(const std::string& asked, const std::string& own,
                                                  const std::vector<std::string>& others) {
  if (asked.empty() || asked == own) return own;
  std::string can = absl::StrCat("\"", own, "\"");
  for (const std::string& other : others) {
    if (asked == other) return other;
    absl::StrAppend(&can, ", \"", other, "\"");
  }
  return absl::FailedPreconditionError(
      absl::StrCat("Benchmark: data_plane \"", asked.substr(0, 64), "\" cannot run on this group (",
                   own, " data plane); it can time ", can,
                   " (join with gpu_data_plane to change the group's plane)"));
}

std::string NcclUniqueIdKey(int64_t generation) {
  return absl::StrCat("gen", generation, "/nccl_unique_id");
}

absl::StatusOr<std::string> ExchangeNcclUniqueId(
    const DataPlaneGroup& group, gloo::rendezvous::Store& store,
    const std::function<absl::StatusOr<std::string>()>& make_id) {
  const std::string key = NcclUniqueIdKey(group.generation);
  const std::string where =
      group.rendezvous_address.empty() ? "the in-process store" : group.rendezvous_address;
  try {
    const std::string origin = absl::StrCat("under \"", key, "\" at ", where);
    if (group.rank == 0) {
      // The outcome is set even when make_id failed, so the other ranks
      // fail with its error now rather than at their timeout.
      const std::string record = EncodeNcclIdRecord(make_id());
      store.set(key, std::vector<char>(record.begin(), record.end()));
      return DecodeNcclIdRecord(record, "rank 0", origin);
    }
    const std::vector<char> value = store.get(key);
    return DecodeNcclIdRecord(absl::string_view(value.data(), value.size()), "rank 0", origin);
  } catch (const std::exception& e) {
    // GrpcStore (server/grpc_store.h) throws with "Timed out" on its deadline.
    const std::string lower = absl::AsciiStrToLower(e.what());
    if (absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout")) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rank 0 did not publish the NCCL unique id under \"", key, "\" at ", where, " within ",
          absl::FormatDuration(group.timeout),
          "; check that rank 0 joined this generation with backend \"nccl\" (", e.what(), ")"));
    }
    return absl::UnavailableError(absl::StrCat("NCCL unique id rendezvous (\"", key, "\" at ",
                                               where, ") failed: ", e.what()));
  }
}

#ifdef MOE_EP_HAVE_CUDA
namespace {

// The one-sided plane of `group` (server/onesided_data_plane.h): its Gloo
// group under "gen<generation>/gpu", then the probe of where the ranks run.
// kFailedPrecondition (every rank alike) when the probe says it cannot work.
absl::StatusOr<std::unique_ptr<DataPlane>> FormOneSidedPlane(
    const DataPlaneGroup& group, const std::shared_ptr<gloo::rendezvous::Store>& store) {
  const std::string context = absl::StrCat("Join (rank ", group.rank, " of ", group.world_size,
                                           ", generation ", group.generation, ")");
  auto with_context = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
  };
  if (absl::Status device = CheckDevice(group.device, VisibleGpuCount(), "nccl"); !device.ok()) {
    return with_context(device);
  }
  // A returning rank (group.rejoin): a group of itself on its in-process
  // store until Readmit (OneSidedDataPlane::Form masks the others).
  const bool alone = group.rejoin && group.world_size > 1;
  absl::StatusOr<std::unique_ptr<core::GlooCollective>> control = core::GlooCollective::Create(
      store, absl::StrCat("gen", group.generation, alone ? "/gpu/alone" : "/gpu"),
      alone ? 0 : group.rank, alone ? 1 : group.world_size, group.data_plane_host, group.timeout);
  if (!control.ok()) return with_context(control.status());
  std::string why;
  absl::StatusOr<bool> works = ProbeOneSidedPlane(**control, group.device, &why);
  if (!works.ok()) return with_context(works.status());
  if (!*works) {
    return absl::FailedPreconditionError(
        absl::StrCat(context, ": the one-sided data plane cannot run here: ", why,
                     "; join with gpu_data_plane \"nccl\""));
  }
  absl::StatusOr<std::unique_ptr<OneSidedDataPlane>> plane =
      OneSidedDataPlane::Form(group, std::move(*control));
  if (!plane.ok()) return with_context(plane.status());
  return std::unique_ptr<DataPlane>(std::move(*plane));
}

}  // namespace
#endif  // MOE_EP_HAVE_CUDA

absl::StatusOr<std::unique_ptr<DataPlane>> FormDataPlane(
    const DataPlaneGroup& group, std::shared_ptr<gloo::rendezvous::Store> store) {
  if (group.plane == PlaneRequest::kGloo) {
    absl::StatusOr<std::unique_ptr<CpuDataPlane>> plane =
        CpuDataPlane::Form(group, std::move(store));
    if (!plane.ok()) return plane.status();
    return std::unique_ptr<DataPlane>(std::move(*plane));
  }
#ifdef MOE_EP_HAVE_CUDA
  if (group.plane != PlaneRequest::kNccl) {
    absl::StatusOr<std::unique_ptr<DataPlane>> one_sided = FormOneSidedPlane(group, store);
    if (one_sided.ok() || group.plane == PlaneRequest::kOneSided ||
        one_sided.status().code() != absl::StatusCode::kFailedPrecondition) {
      return one_sided;
    }
    spdlog::info("Join: gpu_data_plane \"auto\": {}; using the nccl plane",
                 std::string(one_sided.status().message()));
  }
  absl::StatusOr<std::unique_ptr<GpuDataPlane>> plane = GpuDataPlane::Form(group, store);
  if (!plane.ok()) return plane.status();
  return std::unique_ptr<DataPlane>(std::move(*plane));
#else
  return absl::FailedPreconditionError(
      absl::StrCat("data plane \"", PlaneRequestName(group.plane),
                   "\": NCCL backend needs a CUDA build; this worker was built without CUDA "
                   "(use backend \"gloo\" or \"auto\")"));
#endif
}

namespace {

template <typename T>
absl::string_view BytesOf(absl::Span<const T> values) {
  return {reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T)};
}

}  // namespace

absl::StatusOr<core::StepStats> DataPlane::Forward(int layer, absl::Span<const core::bf16_t> hidden,
                                                   absl::Span<const int32_t> topk_ids,
                                                   absl::Span<const float> topk_weights,
                                                   int64_t num_tokens,
                                                   absl::Span<core::bf16_t> output) {
  HostForward io;
  io.hidden = BytesOf(hidden);
  io.topk_ids = BytesOf(topk_ids);
  io.topk_weights = BytesOf(topk_weights);
  io.output = absl::MakeSpan(reinterpret_cast<char*>(output.data()), output.size() * 2);
  return RunForward(layer, io, num_tokens);
}

absl::StatusOr<core::StepStats> DataPlane::ForwardBytes(int layer, const ForwardTensorBytes& in,
                                                        int64_t num_tokens, std::string* output) {
  const size_t hidden_elem = in.hidden_fp32 ? sizeof(float) : sizeof(core::bf16_t);
  if (in.hidden.size() % hidden_elem != 0 || in.topk_ids.size() % sizeof(int32_t) != 0 ||
      in.topk_weights.size() % sizeof(float) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Forward: tensor bytes are not whole elements: hidden ", in.hidden.size(),
                     " (", hidden_elem, " a value), topk_ids ", in.topk_ids.size(),
                     ", topk_weights ", in.topk_weights.size(), " (4 a value)"));
  }
  // The output is written in place into the reply's bytes (no second copy).
  output->resize(in.hidden.size() / hidden_elem * sizeof(core::bf16_t));
  HostForward io;
  io.hidden = in.hidden;
  io.hidden_fp32 = in.hidden_fp32;
  io.topk_ids = in.topk_ids;
  io.topk_weights = in.topk_weights;
  io.output = absl::MakeSpan(output->data(), output->size());
  return RunForward(layer, io, num_tokens);
}

absl::StatusOr<std::vector<int64_t>> DataPlane::SyncTokenCounts(int64_t local_tokens) {
  if (allocated_bytes() == 0) {
    return absl::FailedPreconditionError("SyncTokenCounts: no workspace; call Allocate first");
  }
  // A negative count still joins the all-gather so peers fail fast too.
  ASSIGN_OR_RETURN(std::vector<int64_t> counts, core::AllGatherInt64(collective(), local_tokens));
  RETURN_IF_ERROR(core::ValidateLocalTokens(local_tokens, group_.rank));
  for (int r = 0; r < static_cast<int>(counts.size()); ++r) {
    if (counts[r] < 0) {
      return absl::AbortedError(
          absl::StrCat("rank ", r, " reported an invalid local token count ", counts[r]));
    }
  }
  return counts;
}

absl::Status DataPlane::CommitGeometry(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                                       int64_t local_tokens) {
  if (allocated_bytes() == 0) {
    return absl::FailedPreconditionError("CommitGeometry: no workspace; call Allocate first");
  }
  if (step_dispatcher_ != nullptr) {
    RETURN_IF_ERROR(
        step_dispatcher_->CommitGeometry(epoch, runtime_max_tokens_per_rank, local_tokens));
  } else if (runtime_max_tokens_per_rank < 1 ||
             runtime_max_tokens_per_rank > options_.workspace.capacity_tokens) {
    // No dispatcher now (one-sided windows dropped by a mask): the next one
    // the transport makes takes the geometry, so check its bound here.
    return absl::InvalidArgumentError(
        absl::StrCat("CommitGeometry: runtime_max_tokens_per_rank: expected in [1, ",
                     options_.workspace.capacity_tokens, "] (capacity_tokens), got ",
                     runtime_max_tokens_per_rank));
  }
  geometry_ = {true, epoch, runtime_max_tokens_per_rank};
  return absl::OkStatus();
}

absl::StatusOr<EngineRecvBuffers> DataPlane::EngineReceiveBuffers() {
  return absl::UnimplementedError(absl::StrCat(
      "receive_buffers: the ", data_plane(),
      " data plane has no receive buffers (the one-sided plane's windows hold them, with "
      "--onesided-receive-buffers); pass buffers of your own to dispatch"));
}

absl::Status DataPlane::EngineCheckStep() {
  if (step_dispatcher_ == nullptr) {
    return absl::FailedPreconditionError("check_step: no workspace; AllocateWorkspace first");
  }
  return step_dispatcher_->CheckStep();
}

absl::StatusOr<BenchmarkTimes> DataPlane::Benchmark(const core::EpDispatcherOptions& options,
                                                    const BenchmarkInputs& inputs, int warmup,
                                                    int iterations, int64_t memory_cap_bytes,
                                                    const std::string& data_plane) {
  // The NCCL plane also times the one-sided kernels over NCCL symmetric
  // windows of its own communicator (kernels/onesided/).
  std::vector<std::string> also;
  if (kind_ == PlaneKind::kNccl) also.push_back(PlaneKindName(PlaneKind::kOneSided));
  ASSIGN_OR_RETURN(const std::string plane,
                   ResolveBenchmarkPlane(data_plane, this->data_plane(), also));
  ASSIGN_OR_RETURN(std::unique_ptr<BenchmarkRun> run,
                   MakeBenchmarkRun(options, inputs, memory_cap_bytes, plane));
  BenchmarkTimes times;
  const int total = warmup + iterations;
  for (int i = 0; i < total; ++i) {
    RETURN_IF_ERROR(CallGate(*control_, call_, BenchmarkGatePoint(i, total), kBenchmarkStopHint));
    ASSIGN_OR_RETURN(const BenchmarkRun::PhaseTimes phase, run->Step());
    if (i < warmup) continue;
    times.dispatch_us.push_back(phase.dispatch_us);
    times.combine_us.push_back(phase.combine_us);
  }
  // A failed read fails the run like a failed step: no Finish then.
  ASSIGN_OR_RETURN(times.tokens_sent, run->TokensSent());
  RETURN_IF_ERROR(run->Finish());
  times.data_plane = plane;
  return times;
}

void DataPlane::NewWorkspaceToken() {
  static std::atomic<uint64_t> next{1};
  workspace_token_ = next.fetch_add(1);
}

}  // namespace moe_ep::server
