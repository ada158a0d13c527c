#include "server/request_options.h"

#include <string>
#include <vector>

#include "core/agreement.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/tensor_codec.h"

namespace moe_ep::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::AllocateWorkspaceRequest Allocation() {
  v1::AllocateWorkspaceRequest r;
  r.set_hidden_size(4096);
  r.set_num_experts(256);
  r.set_top_k(8);
  r.set_capacity_tokens(512);
  return r;
}

std::vector<std::string> Names(const std::vector<core::BallotField>& fields) {
  std::vector<std::string> names;
  names.reserve(fields.size());
  for (const core::BallotField& f : fields) names.push_back(f.name);
  return names;
}

TEST(RequestOptions, AllocationCarriesEveryField) {
  v1::AllocateWorkspaceRequest r = Allocation();
  r.set_invalid_expert_id(v1::INVALID_EXPERT_ID_NUM_EXPERTS);
  r.set_dispatch_dtype(v1::DISPATCH_DTYPE_MXFP8);
  r.add_cuda_graph_buckets(64);
  r.add_cuda_graph_buckets(512);
  r.set_redundant_slots_per_rank(8);
  absl::StatusOr<core::EpDispatcherOptions> o =
      AllocationFromRequest(RequestLimits(), r, 4, v1::ModelDescription());
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->redundant_slots_per_rank, 8);
  EXPECT_EQ(o->workspace.ep_size, 4);
  EXPECT_EQ(o->workspace.hidden, 4096);
  EXPECT_EQ(o->workspace.top_k, 8);
  EXPECT_EQ(o->workspace.capacity_tokens, 512);
  EXPECT_EQ(o->workspace.dtype, core::DispatchDType::kMXFP8);
  EXPECT_EQ(o->num_experts, 256);
  EXPECT_EQ(o->invalid_expert_id, 256);  // NUM_EXPERTS convention
  EXPECT_THAT(o->cuda_graph_buckets, ElementsAre(64, 512));
  const std::vector<core::BallotField> fields = AllocationFields(*o);
  EXPECT_THAT(Names(fields), ElementsAre("hidden_size", "top_k", "num_experts", "capacity_tokens",
                                         "dispatch_dtype", "invalid_expert_id",
                                         "cuda_graph_buckets", "redundant_slots_per_rank"));
  EXPECT_EQ(fields[7].value, 8);
  EXPECT_EQ(fields[3].value, 512);
  EXPECT_EQ(fields[6].value, static_cast<int64_t>(core::Fingerprint64("64:512")));
  EXPECT_TRUE(fields[6].is_fingerprint);
}

TEST(RequestOptions, AllocationDefaultsAndChecks) {
  v1::AllocateWorkspaceRequest r = Allocation();
  r.set_capacity_tokens(0);
  r.set_chunked_prefill_size(8192);
  absl::StatusOr<core::EpDispatcherOptions> o =
      AllocationFromRequest(RequestLimits(), r, 2, v1::ModelDescription());
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->workspace.capacity_tokens, 8192);  // max(chunked prefill, 4096)
  EXPECT_EQ(o->invalid_expert_id, -1);

  r = Allocation();
  r.add_cuda_graph_buckets(8);
  r.add_cuda_graph_buckets(8);
  EXPECT_THAT(
      AllocationFromRequest(RequestLimits(), r, 2, {}).status().message(),
      HasSubstr("cuda_graph_buckets: expected positive and strictly ascending, got [8, 8]"));
  r = Allocation();
  r.set_num_experts(3);
  r.set_top_k(2);
  EXPECT_THAT(AllocationFromRequest(RequestLimits(), r, 4, {}).status().message(),
              HasSubstr("num_experts: expected >= 4 (the world size"));
  v1::ModelDescription model;
  model.set_hidden_size(2048);
  EXPECT_THAT(AllocationFromRequest(RequestLimits(), Allocation(), 2, model).status().message(),
              HasSubstr("hidden_size: expected 2048 (the configured model), got 4096"));
}

TEST(RequestOptions, AllocationFingerprintFollowsTheSpec) {
  const auto a = AllocationFromRequest(RequestLimits(), Allocation(), 2, {});
  const auto b = AllocationFromRequest(RequestLimits(), Allocation(), 2, {});
  v1::AllocateWorkspaceRequest other = Allocation();
  other.set_capacity_tokens(513);
  const auto c = AllocationFromRequest(RequestLimits(), other, 2, {});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(AllocationFingerprint(*a), AllocationFingerprint(*b));
  EXPECT_NE(AllocationFingerprint(*a), AllocationFingerprint(*c));
}

v1::ConfigureLayersRequest Configure(int tp, const std::vector<bool>& sparse) {
  v1::ConfigureLayersRequest r;
  r.mutable_layout()->set_tp_size(tp);
  r.mutable_layout()->set_attn_dp_size(tp);
  r.set_a2a_enabled(true);
  r.mutable_model()->set_num_layers(static_cast<int>(sparse.size()));
  for (bool s : sparse) r.mutable_model()->add_sparse_layers(s);
  return r;
}

TEST(RequestOptions, LayerConfigAndItsFields) {
  absl::StatusOr<LayerConfig> c =
      LayerConfigFromRequest(RequestLimits(), Configure(2, {true, false}), 2);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layout.tp_size, 2);
  EXPECT_THAT(c->sparse, ElementsAre(true, false));
  ASSERT_EQ(c->plan.size(), 2u);
  EXPECT_TRUE(c->plan[0].sparse);
  EXPECT_FALSE(c->plan[1].sparse);
  EXPECT_THAT(LayerConfigFromRequest(RequestLimits(), Configure(2, {true}), 4).status().message(),
              HasSubstr("layout.tp_size: expected 4 (the world size), got 2"));
  const std::vector<core::BallotField> fields = LayerConfigFields(Configure(2, {true, false}));
  ASSERT_EQ(fields.size(), 11u);
  EXPECT_EQ(fields[0].name, "layout.tp_size");
  EXPECT_EQ(fields[0].value, 2);
  EXPECT_EQ(fields[5].name, "model.sparse_layers");
  EXPECT_EQ(fields[5].value, static_cast<int64_t>(core::Fingerprint64("SD")));
}

TEST(RequestOptions, ExpertLoadShareAndBytes) {
  std::vector<core::LayerPlan> plan(2);
  plan[0].sparse = true;
  plan[1].sparse = false;
  v1::ModelDescription model;
  model.set_moe_intermediate_size(16);
  core::EpDispatcherOptions allocation;
  allocation.workspace.hidden = 8;
  allocation.num_experts = 4;
  const ExpertLoadContext context{&plan, &model, &allocation, 2, 1, {}};
  v1::LoadExpertsRequest r;
  r.set_layer(0);
  r.set_kind(v1::EXPERT_KIND_SWIGLU);
  r.set_seed(3);
  absl::StatusOr<ExpertLoad> load = ExpertLoadFromRequest(RequestLimits(), r, context);
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->first_expert, 2);  // experts 2, 3 on rank 1 of 2
  EXPECT_EQ(load->num_local_experts, 2);
  EXPECT_EQ(load->intermediate, 16);  // the model's
  EXPECT_EQ(load->weight_bytes, 2 * 3 * 16 * 8 * 2);
  const std::vector<core::BallotField> fields = ExpertLoadFields(r, *load);
  EXPECT_THAT(Names(fields),
              ElementsAre("layer", "kind", "intermediate_size", "seed", "safetensors_path",
                          "name_pattern", "swiglu_limit (x 1e6)", "router_weight_scales_input"));
  EXPECT_EQ(fields[3].value, 3);
  r.set_layer(1);
  EXPECT_THAT(ExpertLoadFromRequest(RequestLimits(), r, context).status().message(),
              HasSubstr("layer: 1 is a dense layer"));
  r.set_layer(2);
  EXPECT_THAT(ExpertLoadFromRequest(RequestLimits(), r, context).status().message(),
              HasSubstr("layer: expected in [0, 2) (the configured layers), got 2"));
  r.set_layer(0);
  r.set_kind(v1::EXPERT_KIND_IDENTITY);
  load = ExpertLoadFromRequest(RequestLimits(), r, context);
  ASSERT_TRUE(load.ok());
  EXPECT_EQ(load->weight_bytes, 0);
}

TEST(RequestOptions, QuantizedExpertLoadsCarryTheirFormat) {
  // issue 35: the fp8 / mxfp4 kinds set the source's format and bytes;
  // Llama-4's input scaling and gpt-oss's limit reach the source.
  std::vector<core::LayerPlan> plan(1);
  plan[0].sparse = true;
  v1::ModelDescription model;
  core::EpDispatcherOptions allocation;
  allocation.workspace.hidden = 256;
  allocation.num_experts = 4;
  const ExpertLoadContext context{&plan, &model, &allocation, 2, 0, {}};
  v1::LoadExpertsRequest r;
  r.set_layer(0);
  r.set_kind(v1::EXPERT_KIND_FP8_BLOCK_SWIGLU);
  r.set_intermediate_size(128);
  r.set_router_weight_scales_input(true);
  absl::StatusOr<ExpertLoad> load = ExpertLoadFromRequest(RequestLimits(), r, context);
  ASSERT_TRUE(load.ok()) << load.status();
  EXPECT_EQ(load->weight_format, core::quant::ExpertWeightFormat::kFp8Block128);
  // Two experts of gate/up [128, 256], down [256, 128]: 1 byte a weight and
  // one fp32 scale per 128 x 128 block (2 per matrix).
  EXPECT_EQ(load->weight_bytes, 2 * (3 * 128 * 256 + 3 * 2 * 4));
  core::ExpertSource source = MakeExpertSource(*load, r, allocation);
  EXPECT_EQ(source.expert_kind(), core::ExpertKind::kFp8SwiGlu);
  EXPECT_EQ(source.router_weight_use, core::RouterWeightUse::kScalesInput);
  EXPECT_EQ(source.weight_bytes(), load->weight_bytes);

  r.set_kind(v1::EXPERT_KIND_MXFP4_GPT_OSS);
  r.set_router_weight_scales_input(false);
  r.set_swiglu_limit(5.5f);
  load = ExpertLoadFromRequest(RequestLimits(), r, context);
  ASSERT_TRUE(load.ok()) << load.status();
  source = MakeExpertSource(*load, r, allocation);
  EXPECT_EQ(source.expert_kind(), core::ExpertKind::kGptOssMxfp4);
  EXPECT_EQ(source.gpt_oss_activation.limit, 5.5f);
  EXPECT_EQ(source.router_weight_use, core::RouterWeightUse::kScalesOutput);
  r.set_swiglu_limit(0.0f);  // 0 = the published 7.0
  EXPECT_EQ(ExpertLoadFromRequest(RequestLimits(), r, context)->swiglu_limit, 7.0f);
  r.set_swiglu_limit(-1.0f);
  EXPECT_THAT(ExpertLoadFromRequest(RequestLimits(), r, context).status().message(),
              HasSubstr("swiglu_limit: expected a finite value >= 0"));
  r.set_swiglu_limit(0.0f);
  r.set_intermediate_size(100);  // not a multiple of the mxfp4 block
  EXPECT_THAT(ExpertLoadFromRequest(RequestLimits(), r, context).status().message(),
              HasSubstr("multiples of 32"));
}

TEST(RequestOptions, ForwardChecksShapesAgainstTheAllocation) {
  core::EpDispatcherOptions allocation;
  allocation.workspace.hidden = 4;
  allocation.workspace.top_k = 2;
  allocation.num_experts = 4;
  v1::ForwardRequest r;
  r.set_layer(1);
  r.set_epoch(7);
  *r.mutable_hidden_states() =
      EncodeBf16(std::vector<core::bf16_t>(12), std::vector<int64_t>{3, 4});
  *r.mutable_topk_ids() = EncodeInt32(std::vector<int32_t>(6), std::vector<int64_t>{3, 2});
  *r.mutable_topk_weights() = EncodeFloat32(std::vector<float>(6), std::vector<int64_t>{3, 2});
  absl::StatusOr<ForwardInputs> in = ForwardFromRequest(RequestLimits(), r, allocation);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->tokens, 3);
  const std::vector<core::BallotField> fields = ForwardFields(*in);
  EXPECT_THAT(Names(fields), ElementsAre("layer", "epoch"));
  EXPECT_EQ(fields[1].value, 7);
  allocation.workspace.top_k = 3;
  EXPECT_THAT(ForwardFromRequest(RequestLimits(), r, allocation).status().message(),
              HasSubstr("topk_ids.shape[1]: expected 3 (the allocated top_k), got 2"));
  allocation.workspace.top_k = 2;
  // DESIGN §7: an id outside [0, 4) other than the invalid id -1 (issue 30).
  *r.mutable_topk_ids() =
      EncodeInt32(std::vector<int32_t>{0, 1, -1, 3, 2, 4}, std::vector<int64_t>{3, 2});
  EXPECT_THAT(ForwardFromRequest(RequestLimits(), r, allocation).status().message(),
              HasSubstr("topk_ids[row 2, choice 1] = 4: outside [0, 4) and not the invalid "
                        "expert id -1"));
  allocation.invalid_expert_id = 4;  // the num_experts convention: 4 pads, -1 does not
  EXPECT_THAT(ForwardFromRequest(RequestLimits(), r, allocation).status().message(),
              HasSubstr("topk_ids[row 1, choice 0] = -1"));
  allocation.invalid_expert_id = -1;
  *r.mutable_topk_ids() = EncodeInt32(std::vector<int32_t>(6), std::vector<int64_t>{3, 2});
  // One byte short of the shape.
  r.mutable_hidden_states()->mutable_data()->pop_back();
  EXPECT_EQ(ForwardFromRequest(RequestLimits(), r, allocation).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RequestOptions, BenchmarkSpec) {
  v1::BenchmarkRequest r;
  r.set_tokens_per_rank(64);
  r.set_hidden_size(32);
  r.set_num_experts(8);
  r.set_top_k(2);
  r.set_iterations(5);
  r.set_warmup(1);
  r.set_routing("skewed");
  r.set_seed(11);
  absl::StatusOr<BenchmarkSpec> spec = BenchmarkFromRequest(RequestLimits(), r, 2);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->options.workspace.capacity_tokens, 64);
  EXPECT_EQ(spec->options.workspace.ep_size, 2);
  EXPECT_EQ(spec->options.workspace.dtype, core::DispatchDType::kBF16);
  EXPECT_EQ(spec->routing, BenchmarkRouting::kSkewed);
  EXPECT_EQ(spec->seed, 11u);
  EXPECT_THAT(
      Names(BenchmarkFields(*spec)),
      ElementsAre("tokens_per_rank", "hidden_size", "num_experts", "top_k", "iterations", "warmup",
                  "routing", "data_plane (0 = the group's, 1 = gloo, 2 = one-sided, 3 = nccl)"));
  EXPECT_EQ(spec->data_plane, "");
  EXPECT_EQ(BenchmarkFields(*spec).back().value, 0);
  r.set_data_plane("one-sided");
  spec = BenchmarkFromRequest(RequestLimits(), r, 2);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->data_plane, "one-sided");
  EXPECT_EQ(BenchmarkFields(*spec).back().value, 2);
  r.set_data_plane("rdma");
  EXPECT_THAT(BenchmarkFromRequest(RequestLimits(), r, 2).status().message(),
              HasSubstr("data_plane: expected \"\" (the group's), \"gloo\", \"one-sided\" or "
                        "\"nccl\", got \"rdma\""));
  r.set_data_plane("");
  r.set_iterations(0);
  EXPECT_THAT(BenchmarkFromRequest(RequestLimits(), r, 2).status().message(),
              HasSubstr("iterations: expected in [1, 10000], got 0"));
  // The range quoted is this worker's (--max-iterations, --max-tokens), not
  // the compile-time bound.
  RequestLimits tight;
  tight.max_iterations = 50;
  tight.max_tokens = 64;
  EXPECT_THAT(BenchmarkFromRequest(tight, r, 2).status().message(),
              HasSubstr("iterations: expected in [1, 50], got 0"));
  r.set_iterations(1);
  r.set_tokens_per_rank(0);
  EXPECT_THAT(BenchmarkFromRequest(tight, r, 2).status().message(),
              HasSubstr("tokens_per_rank: expected in [1, 64], got 0"));
}

TEST(RequestOptions, JoinDefaults) {
  v1::JoinRequest r;
  r.set_world_size(1);
  r.set_rank(0);
  r.set_generation(3);
  r.set_backend("gloo");
  JoinDefaults defaults;
  defaults.timeout = absl::Seconds(7);
  defaults.data_plane_host = "127.0.0.2";
  absl::StatusOr<JoinArgs> args = JoinArgsFromRequest(RequestLimits(), r, defaults);
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_EQ(args->backend, "gloo");
  EXPECT_EQ(args->timeout, absl::Seconds(7));
  EXPECT_EQ(args->data_plane_host, "127.0.0.2");
  EXPECT_EQ(args->gpu_data_plane, "");  // Gloo has no GPU data plane
  r.set_gpu_data_plane("one-sided");
  args = JoinArgsFromRequest(RequestLimits(), r, defaults);
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_EQ(args->gpu_data_plane, "");
  r.set_gpu_data_plane("nvshmem");
  EXPECT_EQ(JoinArgsFromRequest(RequestLimits(), r, defaults).status().code(),
            absl::StatusCode::kInvalidArgument);
  r.set_gpu_data_plane("");
  r.set_world_size(2);
  EXPECT_THAT(JoinArgsFromRequest(RequestLimits(), r, defaults).status().message(),
              HasSubstr("rendezvous_address: required"));
}

}  // namespace
}  // namespace moe_ep::server
