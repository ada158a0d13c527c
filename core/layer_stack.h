#pragma once

// A stack of K decoder layers run under DP attention + EP, one rank per
// process or thread (DistributedLayerStack), and the same math computed in one
// process for every DP group's tokens (ReferenceLayerStack). This is the
// end-to-end check of the layer plan (DESIGN §3, §4): the distributed output
// must equal the reference within the tolerance stated below.
//
// One layer, on token rows x (the "model" is deterministic stand-ins, all
// weights a pure function of config.seed and the layer index):
//   1. input RMSNorm (fused residual add; the first layer sets residual = x);
//   2. attention stand-in: y = x W_l with W_l [H, H] seeded, no mixing across
//      tokens. With attn_tp_size > 1 attention-TP rank j multiplies only its
//      slice of the input dimension (rows [lo_j, hi_j) of W_l, a contiguous
//      split of H), so y is a partial sum across the attention-TP group, as a
//      row-parallel output projection would leave it;
//   3. the before-MLP step of the plan (reduces the partial sums, adds the
//      residual, post-attention RMSNorm);
//   4. the MLP:
//      - sparse, MLP SCATTERED (a2a on): routed MoE through EpDispatcher
//        (bf16 at the dispatch boundary, SwiGLU experts, contiguous placement
//        over all ranks). Routing is RouteToken(seed, layer, global token id),
//        a function of the token's position in the whole batch, so every rank
//        and the reference route identically; padding rows carry id -1 and are
//        never sent;
//      - sparse, MLP FULL (a2a off): every rank applies its own experts to all
//        FULL rows in fp32 and the partial results are all-reduced over TP;
//      - dense SwiGLU (gate/up [I, H], down [H, I], seeded): SCATTERED
//        (moe_dense_tp_size 1) runs the whole MLP on each rank's rows; FULL
//        shards I over the TP group (gate/up rows, down columns) and
//        all-reduces over TP; TP_ATTN_FULL (moe_dense_tp_size ==
//        attn_tp_size, sglang 23996) shards over the attention-TP group and
//        all-reduces there. A FULL MLP skips its all-reduce when the after-MLP
//        step resolves to the MAX_LEN reduce-scatter (allow_reduce_scatter);
//   5. the after-MLP step of the plan.
// The stack's output is the residual stream after the last layer: hidden +
// residual (hidden alone when the last step folded the residual in), no final
// norm.
//
// Global token ids: DP group g's i-th token is sum(counts[0..g)) + i; the
// reference takes the groups' tokens concatenated in DP order.
//
// Tolerance: the distributed and reference computations differ only in the
// order of fp32 additions (attention and dense partial sums, all-reduce and
// reduce-scatter order) and in the bf16 roundings those differences can flip
// at the MoE boundary (one bf16 ulp, 2^-8 relative, per flipped element).
// Tests use |out - ref| <= 1e-4 * (1 + |ref|) for stacks of dense layers
// (fp32 only) and 2^-7 * (1 + |ref|) per element with sparse layers (one
// flipped bf16 rounding is 2^-8 relative; measured errors are ~1e-6).
//
// Source: DESIGN §3, §4, §6, §7; issue 4.

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/dp_padding.h"
#include "core/layer_plan.h"
#include "core/parallel_groups.h"
#include "core/step_executor.h"
#include "core/stop_check.h"

namespace moe_ep::core {

struct LayerStackConfig {
  ParallelLayout layout;            // tp_size = world (DESIGN §2)
  std::vector<bool> sparse_layers;  // [K], true = MoE layer
  bool a2a_enabled = true;          // sparse MLP SCATTERED (true) or FULL
  int64_t hidden = 32;              // H
  int64_t dense_intermediate = 64;  // I of the dense SwiGLU; a multiple of tp_size
  int64_t moe_intermediate = 32;    // I of each routed expert
  int num_experts = 8;              // >= tp_size (every rank owns an expert)
  int top_k = 2;                    // distinct experts per token, <= num_experts
  uint64_t seed = 1;
  float rms_eps = 1e-6f;
  // Let a FULL MLP skip its all-reduce and the after-MLP step reduce-scatter
  // under MAX_LEN padding (core/layer_plan.h ResolveAfterMlpOp).
  bool allow_reduce_scatter = false;
  int64_t capacity_tokens = 1024;  // per-rank dispatch capacity N (DESIGN §5)
};

// Errors (kInvalidArgument naming the field, expected and got): layout
// invalid; sparse_layers empty; hidden, intermediates < 1; dense_intermediate
// not a multiple of tp_size; num_experts < tp_size; top_k outside
// [1, num_experts]; rms_eps <= 0; capacity_tokens < 1.
absl::Status ValidateLayerStackConfig(const LayerStackConfig& config);

// RouteToken()
//
// The routing of global token `token` in sparse layer `layer`: `top_k`
// distinct expert ids in [0, num_experts) into ids[0..top_k) and weights in
// (0, 1) summing to 1 into weights[0..top_k). A pure function of its
// arguments (counter-based hashing). REQUIRES: 1 <= top_k <= num_experts.
void RouteToken(uint64_t seed, int layer, int64_t token, int num_experts, int top_k, int32_t* ids,
                float* weights);

// ReferenceLayerStack()
//
// The whole stack in one process for `dp_tokens` ([attn_dp_size] entries,
// DP group g's tokens [n_g, H] fp32; groups may be empty). Returns the output
// [sum n_g, H] fp32, groups concatenated in DP order.
// Errors: ValidateLayerStackConfig errors; kInvalidArgument when dp_tokens
// does not have attn_dp_size entries or an entry is not a multiple of H.
// `on_layer`, when set, is called after each layer with its index (progress
// of long references: a real model's sparse layer builds all its experts).
absl::StatusOr<std::vector<float>> ReferenceLayerStack(
    const LayerStackConfig& config, const std::vector<std::vector<float>>& dp_tokens,
    const std::function<void(int layer)>& on_layer = nullptr);

class DistributedLayerStack {
 public:
  // Plans the layers (PlanLayers), generates this rank's weights (its
  // attention and dense shards, its experts) and, when a sparse layer runs
  // SCATTERED, an EpDispatcher over groups->world(). `groups` is not owned
  // and must outlive the stack; config.layout must equal groups->layout().
  // `executor` runs the layers' communication steps (core/step_program.h):
  // null = a HostStepExecutor over `groups`; otherwise one made for this
  // rank of the same layout (kernels::StagedStepExecutor on NCCL groups).
  // `before_layer` (null = none) runs on every rank before the weights of
  // each layer l >= 1 are made (the server's call gate, a collective): its
  // error stops the build there and is returned.
  // `stop` (core/stop_check.h; null = never) is polled while a layer's
  // weights are made (each kGenerateStopChunk weights): once it answers
  // true, that layer's build ends and `before_layer` of the next layer
  // still runs (the peers wait in it; its error is returned). After the
  // last layer, or when `before_layer` lets it on, the LocalStop is
  // returned: the caller must then pass the gate the peers wait in next
  // (server/layer_stack_runner.cc). In a group, `before_layer` must stop
  // every rank whenever `stop` fired on one (server::CallGate on the same
  // server::CallBound does; issue 13 item 6).
  // Errors: ValidateLayerStackConfig and PlanLayers errors; kInvalidArgument
  // for a null groups or a layout that differs from the groups'; EpDispatcher
  // creation errors; `before_layer`'s; LocalStop.
  static absl::StatusOr<std::unique_ptr<DistributedLayerStack>> Create(
      const ParallelGroups* groups, const LayerStackConfig& config,
      std::unique_ptr<StepExecutor> executor = nullptr,
      const std::function<absl::Status(int layer)>& before_layer = nullptr,
      const StopCheck& stop = nullptr);

  // Forward()
  //
  // Runs all layers for this DP group's `tokens` [num_tokens, H] fp32; every
  // attention-TP rank of the group passes the same tokens. Returns this DP
  // group's output [num_tokens, H]. A collective over the world: every rank
  // calls it for the same step, zero-token ranks included.
  // Errors: kInvalidArgument for num_tokens < 0 or tokens.size() !=
  // num_tokens * H (before any communication), or when the ranks of a DP
  // group pass different token counts (detected on every rank after the count
  // all-gather, naming the DP group and ranks); kResourceExhausted when a
  // rank's SCATTERED rows exceed capacity_tokens; collective and dispatcher
  // errors; and those of `before_layer` (null = none), which runs on every
  // rank before each layer l >= 1 (the server's call gate, itself a
  // collective): its error stops the stack there and is returned.
  absl::StatusOr<std::vector<float>> Forward(
      absl::Span<const float> tokens, int64_t num_tokens,
      const std::function<absl::Status(int layer)>& before_layer = nullptr);

  const std::vector<LayerPlan>& plans() const;
  // The executor of the communication steps ("host" or "device").
  const StepExecutor& executor() const;
  // The DP layout of the last Forward (padding mode, rows).
  const DpGatherLayout& last_layout() const;
  // The after-MLP op each layer ran in the last Forward.
  const std::vector<AfterMlpOp>& last_after_mlp_ops() const;

  ~DistributedLayerStack();

 private:
  struct Impl;
  explicit DistributedLayerStack(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe_ep::core
