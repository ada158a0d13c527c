#pragma once

// Request-to-options conversion of the moe_ep.v1.Worker service (issue 10
// item 5): each collective RPC's request, checked against the worker's
// request limits (server/request_limits.h, issue 13 item 6) and against the
// group and configuration it runs in, becomes the core/ options its handler
// calls with. Every check of a request's own fields lives here, so the
// handlers in server/worker_service.cc only validate state, vote, call and
// reply.
//
// Errors are kInvalidArgument naming the field, expected vs got (the same
// wording the handlers always used); LoadExperts' checkpoint path also gives
// kPermissionDenied / kNotFound (server/path_policy.h).
//
// The *Fields() functions give a converted request's spec field by field for
// the cross-rank vote (core/agreement.h; issue 12 item 2): every field that
// must agree across ranks, by its request name.
//
// Pure functions but for ExpertLoadFromRequest, which resolves the
// checkpoint's path on disk; thread-safe. Source: DESIGN §5-§8.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/agreement.h"
#include "core/bf16.h"
#include "core/ep_dispatcher.h"
#include "core/expert_source.h"
#include "core/layer_plan.h"
#include "moe_ep/v1/worker.pb.h"
#include "server/benchmark_inputs.h"
#include "server/data_plane.h"
#include "server/request_limits.h"
#include "server/tensor_codec.h"

namespace moe_ep::server {

// Largest sizes a request may ask for; beyond them a multiplication of sizes
// could overflow int64 before the memory cap is consulted.
inline constexpr int64_t kMaxHidden = int64_t{1} << 20;
inline constexpr int64_t kMaxTokens = int64_t{1} << 24;
inline constexpr int kMaxExperts = 1 << 16;
inline constexpr int kMaxBenchmarkIterations = 100000;

// ------------------------------------------------------------------- Join

// The normalized arguments a group is joined with (also the idempotency key
// of Join: equal arguments on a formed group are a no-op).
struct JoinArgs {
  int world_size = 0;
  int rank = 0;
  std::string backend;  // resolved: "gloo" or "nccl"
  // backend "nccl": "auto", "one-sided" or "nccl" (ResolveGpuDataPlane);
  // "" for gloo.
  std::string gpu_data_plane;
  std::string rendezvous_address;
  int64_t generation = 0;
  absl::Duration timeout;
  std::string data_plane_host;
  std::string rendezvous_secret;
  std::vector<std::string> rendezvous_addresses;  // [world_size] or empty (rank masks off)
  bool rejoin = false;  // a restarted rank joining alone to be re-admitted (DESIGN §15)
  bool operator==(const JoinArgs&) const = default;
};

// The worker's defaults for what a JoinRequest leaves unset.
struct JoinDefaults {
  std::string backend = "auto";
  absl::Duration timeout = absl::Seconds(30);
  std::string data_plane_host = "127.0.0.1";
  int device = 0;                       // the CUDA device NCCL would run on
  int visible_gpus = 0;                 // server/backend_selection.h VisibleGpuCount()
  std::string gpu_data_plane = "nccl";  // for backend nccl (ResolveGpuDataPlane)
};

// JoinArgsFromRequest()
//
// world_size >= 1, rank in [0, world_size), generation >= 1, timeout_ms >= 0
// (0 = the default), rendezvous_address required when world_size > 1,
// rendezvous_addresses empty or one non-empty address per rank with entry 0
// equal to rendezvous_address (kInvalidArgument naming the entry), the
// backend resolved and its device present, gpu_data_plane a known name
// (server/backend_selection.h), rendezvous_secret sendable as gRPC metadata
// (server/store_limits.h IsSendableSecret).
absl::StatusOr<JoinArgs> JoinArgsFromRequest(const RequestLimits& limits,
                                             const v1::JoinRequest& request,
                                             const JoinDefaults& defaults);

// -------------------------------------------------------- ConfigureLayers

struct LayerConfig {
  core::ParallelLayout layout;
  std::vector<bool> sparse;  // [model.num_layers]
  bool a2a_enabled = true;
  std::vector<core::LayerPlan> plan;
};

// LayerConfigFromRequest()
//
// The model's sizes (num_layers >= 1 with as many sparse_layers entries;
// sizes >= 0; top_k <= num_experts when both are set), a valid layout whose
// tp_size is `world_size`, and the plan of its layers (core::PlanLayers).
absl::StatusOr<LayerConfig> LayerConfigFromRequest(const RequestLimits& limits,
                                                   const v1::ConfigureLayersRequest& request,
                                                   int world_size);

// The fields ranks agree on: layout.*, a2a_enabled, model.sparse_layers
// (fingerprint of its 'S'/'D' pattern), model.name (fingerprint) and the
// model's sizes.
std::vector<core::BallotField> LayerConfigFields(const v1::ConfigureLayersRequest& request);

// The fingerprint ConfigureLayers reports: of the plan (core::PlanFingerprint)
// and the model's name and sizes.
uint64_t LayerConfigFingerprint(const v1::ConfigureLayersRequest& request,
                                const LayerConfig& config);

// ------------------------------------------------------ AllocateWorkspace

// AllocationFromRequest()
//
// core::EpDispatcherOptions of the request for a `world_size`-rank group:
// MoE sizes (core::ValidateMoeSizes), capacity (0 = the default of
// chunked_prefill_size; in [1, kMaxTokens]), dispatch dtype, invalid expert
// id convention, cuda_graph_buckets positive and strictly ascending,
// num_experts >= world_size, and hidden_size, num_experts, top_k equal to
// `model`'s where the configured model gives them (non-zero).
absl::StatusOr<core::EpDispatcherOptions> AllocationFromRequest(
    const RequestLimits& limits, const v1::AllocateWorkspaceRequest& request, int world_size,
    const v1::ModelDescription& model);

// The allocation's spec fields (hidden_size, top_k, num_experts,
// capacity_tokens, dispatch_dtype, invalid_expert_id, cuda_graph_buckets).
std::vector<core::BallotField> AllocationFields(const core::EpDispatcherOptions& options);

// One fingerprint of the allocation's spec (same spec = same value): a
// repeated AllocateWorkspace with it keeps the workspace and the experts.
uint64_t AllocationFingerprint(const core::EpDispatcherOptions& options);

// ------------------------------------------------------------ LoadExperts

// What LoadExperts loads on this rank.
struct ExpertLoad {
  int layer = 0;
  bool identity = false;      // EXPERT_KIND_IDENTITY: no weights
  int64_t intermediate = 0;   // I of SwiGLU experts (0 for identity)
  std::string checkpoint;     // canonical path under --checkpoint-dir; "" = seeded
  int first_expert = 0;       // this rank's share: its first (smallest) expert
  int num_local_experts = 0;  // distinct experts of the share
  // The share under the layer's placement table (DESIGN §15): its distinct
  // experts, ascending, and the logical expert of each slot.
  std::vector<int> expert_ids;
  std::vector<int> slot_experts;
  int64_t weight_bytes = 0;  // the share's weights in their format (quant::ExpertWeightBytes)
  // The weights' format by kind (EXPERT_KIND_FP8_BLOCK_SWIGLU,
  // EXPERT_KIND_MXFP4_GPT_OSS; issue 35), gpt-oss's limit, and Llama-4's
  // input scaling.
  core::quant::ExpertWeightFormat weight_format = core::quant::ExpertWeightFormat::kBf16;
  float swiglu_limit = core::quant::kGptOssSwiGluLimit;
  bool router_weight_scales_input = false;
};

// The state LoadExperts is checked against.
struct ExpertLoadContext {
  const std::vector<core::LayerPlan>* plan = nullptr;  // configured layers
  const v1::ModelDescription* model = nullptr;         // configured model
  const core::EpDispatcherOptions* allocation = nullptr;
  int world_size = 1;
  int rank = 0;
  std::vector<std::string> checkpoint_dirs;  // --checkpoint-dir
  // The layer's placement table; null = the contiguous placement.
  const core::PlacementTable* placement = nullptr;
};

// ExpertLoadFromRequest()
//
// layer >= 0, a configured sparse layer; kind SWIGLU, IDENTITY,
// FP8_BLOCK_SWIGLU or MXFP4_GPT_OSS; intermediate_size >= 0 (0 = the model's
// moe_intermediate_size, required for the SwiGLU kinds); safetensors_path
// only for the SwiGLU kinds, with a name_pattern (optional for
// MXFP4_GPT_OSS), and resolved under the checkpoint directories;
// swiglu_limit >= 0 (0 = 7.0).
absl::StatusOr<ExpertLoad> ExpertLoadFromRequest(const RequestLimits& limits,
                                                 const v1::LoadExpertsRequest& request,
                                                 const ExpertLoadContext& context);

// layer, kind, intermediate_size, seed, safetensors_path and name_pattern
// (fingerprints of the texts).
std::vector<core::BallotField> ExpertLoadFields(const v1::LoadExpertsRequest& request,
                                                const ExpertLoad& load);

// ------------------------------------------------------- InstallPlacement

// PlacementFromRequest()
//
// The table of an InstallPlacementRequest (DESIGN §15): layer a configured
// sparse layer; one PlacementRank per rank of `world_size`; at most
// max_experts slots a rank; core::PlacementTable::FromSlotExperts with the
// workspace's num_experts; a non-zero request fingerprint equal to the
// table's; then core::ValidatePlacement against `allocation` (the slot
// budget). Errors: kInvalidArgument naming the field, rank or slot,
// expected and got. Pure.
absl::StatusOr<core::PlacementTable> PlacementFromRequest(
    const RequestLimits& limits, const v1::InstallPlacementRequest& request,
    const std::vector<core::LayerPlan>& plan, const core::EpDispatcherOptions& allocation,
    int world_size);

// layer, and the table's fingerprint (so a rank with another table is named
// with its fingerprint).
std::vector<core::BallotField> PlacementFields(int layer, const core::PlacementTable& table);

// -------------------------------------------------------- SyncTokenCounts

// epoch >= 0 and local_tokens >= 0.
absl::Status CheckSyncTokenCounts(const v1::SyncTokenCountsRequest& request);
// epoch, runtime_max_tokens_per_rank and local_tokens >= 0.
absl::Status CheckCommitGeometry(const v1::CommitGeometryRequest& request);

// ---------------------------------------------------------------- Forward

struct ForwardInputs {
  int layer = 0;
  int64_t epoch = 0;
  int64_t tokens = 0;          // T
  ForwardTensorBytes tensors;  // views of the request's bytes: [T, H], [T, K], [T, K]
};

// ForwardFromRequest()
//
// layer, epoch >= 0; the three tensors checked (dtype: hidden bf16 or fp32,
// ids int32, weights fp32; shape; byte length), with T rows each, H = the
// allocated hidden size, K = the allocated top_k, every id in
// [0, num_experts) or the allocated invalid id (core::ValidateExpertIds:
// kInvalidArgument naming the row and the id). Copies no tensor: the
// result views `request`'s bytes and is valid while it lives.
absl::StatusOr<ForwardInputs> ForwardFromRequest(const RequestLimits& limits,
                                                 const v1::ForwardRequest& request,
                                                 const core::EpDispatcherOptions& allocation);

// layer and epoch (rows differ per rank by design).
std::vector<core::BallotField> ForwardFields(const ForwardInputs& inputs);

// -------------------------------------------------------------- Benchmark

struct BenchmarkSpec {
  core::EpDispatcherOptions options;  // capacity = tokens_per_rank, bf16
  BenchmarkRouting routing = BenchmarkRouting::kUniform;
  int warmup = 0;
  int iterations = 1;
  uint64_t seed = 0;
  std::string data_plane;  // "" (the group's), "gloo", "one-sided" or "nccl"
};

// BenchmarkFromRequest()
//
// tokens_per_rank in [1, kMaxTokens], MoE sizes, iterations in
// [1, kMaxBenchmarkIterations], warmup in [0, kMaxBenchmarkIterations],
// routing "uniform" / "skewed", num_experts >= world_size, data_plane ""
// or a plane name (whether the group can run it is the plane's to say).
absl::StatusOr<BenchmarkSpec> BenchmarkFromRequest(const RequestLimits& limits,
                                                   const v1::BenchmarkRequest& request,
                                                   int world_size);

// tokens_per_rank, hidden_size, num_experts, top_k, iterations, warmup and
// routing (the seed may differ: each rank draws its own inputs anyway).
std::vector<core::BallotField> BenchmarkFields(const BenchmarkSpec& spec);

// MakeExpertSource()
//
// What LoadExperts hands the data plane (issue 10 item 6): this rank's share
// of the layer checked by ExpertLoadFromRequest, as the description the
// plane makes the weights from (core/expert_source.h): identity, the
// canonical checkpoint, or the request's seed. Pure; validate the result
// with core::ValidateExpertSource.
core::ExpertSource MakeExpertSource(const ExpertLoad& load, const v1::LoadExpertsRequest& request,
                                    const core::EpDispatcherOptions& options);

}  // namespace moe_ep::server
