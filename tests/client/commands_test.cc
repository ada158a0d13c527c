// Tests of the offline commands and the command helpers that need no workers:
// client/plan_command.h, client/workspace_command.h, client/status_command.h,
// client/bench_command.h (validation), client/model_source.h,
// client/tensor_message.h.

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_split.h"
#include "client/bench_command.h"
#include "client/model_source.h"
#include "client/plan_command.h"
#include "client/status_command.h"
#include "client/tensor_message.h"
#include "client/workspace_command.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;

std::string DataDir() {
  const char* env = std::getenv("MOE_EP_DATA_DIR");
  return env != nullptr ? env : MOE_EP_DATA_DIR;
}

TEST(ResolveModel, PresetAndPath) {
  auto preset = ResolveModel("qwen3-30b-a3b");
  ASSERT_TRUE(preset.ok()) << preset.status();
  EXPECT_EQ(preset->hidden_size, 2048);
  EXPECT_EQ(preset->num_experts, 128);
  EXPECT_EQ(ResolveModel("no-such-preset").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ResolveModel("/no/such/config.json").status().code(), absl::StatusCode::kNotFound);
  const std::string path = DataDir() + "/models/DeepSeek-V3.json";
  if (!std::ifstream(path)) GTEST_SKIP() << "no data dir at " << DataDir();
  auto file = ResolveModel(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->hidden_size, 7168);
  EXPECT_EQ(file->num_experts, 256);
}

TEST(RunWorkspaceCommand, PrintsDesignCheckValue) {
  // DESIGN §5: E=8, N=16384, H=7168, K=8, bf16 -> 3,769,368,960 bytes per rank.
  WorkspaceCommandOptions o;
  o.model = "deepseek-v3";
  o.ep_size = 8;
  o.max_tokens = 16384;
  std::ostringstream out;
  ASSERT_TRUE(RunWorkspaceCommand(o, out).ok());
  EXPECT_THAT(out.str(), HasSubstr("dispatch bytes per token                    14400  14.1 KiB"));
  EXPECT_THAT(out.str(), HasSubstr("FlashInfer-compatible total per rank   3769368960  3.51 GiB"));
  EXPECT_THAT(out.str(), HasSubstr("dispatch_send"));
}

TEST(RunWorkspaceCommand, RejectsBadArguments) {
  std::ostringstream out;
  WorkspaceCommandOptions o;
  o.ep_size = 0;
  o.max_tokens = 1;
  EXPECT_THAT(RunWorkspaceCommand(o, out).message(), HasSubstr("--ep"));
  o.ep_size = 2;
  o.max_tokens = 0;
  EXPECT_THAT(RunWorkspaceCommand(o, out).message(), HasSubstr("--max-tokens"));
  o.max_tokens = 1;
  o.dtype = "fp8";
  EXPECT_EQ(RunWorkspaceCommand(o, out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RunPlanCommand, PrintsTheTable) {
  PlanCommandOptions o;
  o.model = "tiny-moe";  // layer 0 dense, 1..3 sparse
  o.tp_size = 4;
  o.attn_dp_size = 4;
  o.moe_dense_tp_size = 1;
  std::ostringstream out;
  ASSERT_TRUE(RunPlanCommand(o, out).ok());
  EXPECT_THAT(out.str(), HasSubstr("tiny-moe: 4 layers (3 sparse), tp 4, attn_dp 4 (attn_tp 1)"));
  EXPECT_THAT(out.str(), HasSubstr("SCATTERED"));
}

TEST(RunPlanCommand, RejectsBadLayout) {
  PlanCommandOptions o;
  o.tp_size = 4;
  o.attn_dp_size = 3;  // does not divide tp
  std::ostringstream out;
  EXPECT_EQ(RunPlanCommand(o, out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RenderWorkerTable, ShowsStatesAndUnreachable) {
  v1::GetStatusResponse s;
  s.set_rank(1);
  s.set_world_size(2);
  s.set_state(v1::WORKER_STATE_ALLOCATED);
  s.set_backend("gloo");
  s.set_device_name("cpu");
  s.set_workspace_bytes(2048);
  s.set_geometry_epoch(3);
  s.set_runtime_max_tokens_per_rank(17);
  std::vector<absl::StatusOr<v1::GetStatusResponse>> statuses = {
      s, absl::UnavailableError("connection refused")};
  const std::string text = RenderWorkerTable({"127.0.0.1:1", "127.0.0.1:2"}, statuses);
  EXPECT_THAT(text, HasSubstr("1/2   127.0.0.1:1  ALLOCATED"));
  EXPECT_THAT(text, HasSubstr("2.00 KiB"));
  EXPECT_THAT(text, HasSubstr("UNREACHABLE"));
  EXPECT_THAT(text, HasSubstr("UNAVAILABLE: connection refused"));
  EXPECT_EQ(WorkerStateName(v1::WORKER_STATE_JOINED), "JOINED");
  // No lease: "-" in the lease column, which sits between forwards and errors.
  EXPECT_THAT(text, HasSubstr("forwards  lease  errors"));
}

TEST(RenderWorkerTable, ShowsTheLeaseOwnerAndItsTimeLeft) {
  v1::GetStatusResponse s;
  s.set_rank(0);
  s.set_world_size(1);
  s.set_state(v1::WORKER_STATE_ALLOCATED);
  s.set_lease_owner("coordinator@pod-0");
  s.set_lease_remaining_ms(12345);
  const std::string text = RenderWorkerTable({"127.0.0.1:1"}, {s});
  EXPECT_THAT(text, HasSubstr("coordinator@pod-0 (12.3 s left)"));
  const nlohmann::json j = WorkerStatusJson({"127.0.0.1:1"}, {s});
  EXPECT_EQ(j[0]["lease_owner"], "coordinator@pod-0");
  EXPECT_EQ(j[0]["lease_remaining_ms"], 12345);
}

TEST(DescribeWorkerError, NamesTheFlagThatFixesIt) {
  ClientSecurityOptions plaintext;
  ClientSecurityOptions tls;
  tls.tls_ca = "/ca.pem";
  ClientSecurityOptions token = tls;
  token.auth_token_file = "/token";
  const absl::Status unauthenticated = absl::UnauthenticatedError("missing bearer token");
  WorkerErrorView v = DescribeWorkerError(unauthenticated, tls);
  EXPECT_EQ(v.state, "UNAUTHENTICATED");
  EXPECT_THAT(v.hint, HasSubstr("pass --auth-token-file"));
  v = DescribeWorkerError(unauthenticated, token);
  EXPECT_EQ(v.state, "UNAUTHENTICATED");
  EXPECT_THAT(v.hint, HasSubstr("rejected the token of --auth-token-file /token"));
  const absl::Status closed = absl::UnavailableError("Socket closed");
  v = DescribeWorkerError(closed, plaintext);
  EXPECT_EQ(v.state, "UNREACHABLE");
  EXPECT_THAT(v.hint, HasSubstr("if it serves TLS, pass --tls-ca"));
  v = DescribeWorkerError(absl::UnavailableError("Ssl handshake failed: WRONG_VERSION_NUMBER"),
                          tls);
  EXPECT_THAT(v.hint, HasSubstr("a plaintext worker needs no --tls-ca"));
  // A refused connection has no hint: nothing listens there.
  v = DescribeWorkerError(absl::UnavailableError("failed to connect: Connection refused"),
                          plaintext);
  EXPECT_EQ(v.state, "UNREACHABLE");
  EXPECT_EQ(v.hint, "");
  EXPECT_EQ(DescribeWorkerError(absl::PermissionDeniedError("no"), tls).state, "PERMISSION_DENIED");
}

TEST(RenderWorkerTable, UnauthenticatedWorkerShowsAsSuchWithTheHint) {
  ClientSecurityOptions tls;
  tls.tls_ca = "/ca.pem";
  std::vector<absl::StatusOr<v1::GetStatusResponse>> statuses = {
      absl::UnauthenticatedError("missing bearer token")};
  const std::string text = RenderWorkerTable({"127.0.0.1:1"}, statuses, tls);
  EXPECT_THAT(text, HasSubstr("UNAUTHENTICATED"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("UNREACHABLE")));
  EXPECT_THAT(text, HasSubstr("--auth-token-file"));
}

TEST(RenderWorkerTable, AnErrorEveryRankRepeatsPrintsOnceWithTheRanks) {
  // Each worker's message names its own address; once that is taken out they
  // are the same error.
  const std::vector<std::string> targets = {"127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13"};
  std::vector<absl::StatusOr<v1::GetStatusResponse>> statuses;
  statuses.reserve(targets.size());
  for (const std::string& t : targets) {
    statuses.push_back(absl::UnavailableError("ipv4:" + t + ": Socket closed"));
  }
  const std::string text = RenderWorkerTable(targets, statuses);
  // Wrapped at 100 columns, continuation lines indented.
  EXPECT_THAT(text, HasSubstr("error 1, ranks 0-2 (every worker): UNAVAILABLE: "
                              "ipv4:<address>: Socket closed (hint: the worker\n    closed a "
                              "plaintext connection"));
  size_t count = 0;
  for (size_t at = text.find("Socket closed"); at != std::string::npos;
       at = text.find("Socket closed", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << text;
  EXPECT_THAT(text, HasSubstr("error 1 (below)"));

  // Two of three: the ranks are listed, not "every worker"; the third's own
  // error stays in its row.
  statuses[1] = absl::UnauthenticatedError("missing bearer token");
  const std::string mixed = RenderWorkerTable(targets, statuses);
  EXPECT_THAT(mixed, HasSubstr("error 1, ranks 0, 2: UNAVAILABLE"));
  EXPECT_THAT(mixed, ::testing::Not(HasSubstr("every worker")));
  EXPECT_THAT(mixed, HasSubstr("UNAUTHENTICATED: missing bearer token"));
}

TEST(RenderWorkerTable, LongErrorsWrapInsteadOfWideningTheTable) {
  const std::string long_error =
      "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to "
      "connect to remote host: Connection refused; and a great deal more text that a resolver "
      "or a TLS library might add to it, which is long enough to be well past two hundred "
      "columns when it sits in one cell of the table next to eleven other columns";
  ASSERT_GT(long_error.size(), 250u);
  std::vector<absl::StatusOr<v1::GetStatusResponse>> statuses = {
      absl::UnavailableError(long_error)};
  const std::string text = RenderWorkerTable({"127.0.0.1:1"}, statuses);
  size_t widest = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) widest = std::max(widest, line.size());
  EXPECT_LE(widest, 200u) << text;
  EXPECT_THAT(text, HasSubstr("Connection refused;"));
}

TEST(RunWorkspaceCommand, JsonHasTheDesignCheckValues) {
  // DESIGN §5: E=8, N=16384, H=7168, K=8, bf16 -> 3,769,368,960 bytes per
  // rank; aux check values E=2, N=3, H=64, K=2 -> 1152 (total 2816).
  WorkspaceCommandOptions o;
  o.model = "deepseek-v3";
  o.ep_size = 8;
  o.max_tokens = 16384;
  o.json = true;
  std::ostringstream out;
  ASSERT_TRUE(RunWorkspaceCommand(o, out).ok());
  const nlohmann::json j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["model"], "deepseek-v3");
  EXPECT_EQ(j["ep"], 8);
  EXPECT_EQ(j["capacity_tokens"], 16384);
  EXPECT_EQ(j["dtype"], "bf16");
  EXPECT_EQ(j["dispatch_bytes_per_token"], 2 * 7168 + 8 * 8);  // 2H + 8K = 14400
  EXPECT_EQ(j["combine_bytes_per_token"], 2 * 7168);
  EXPECT_EQ(j["flashinfer"]["total_bytes"].get<int64_t>(), 3769368960);
  EXPECT_EQ(j["flashinfer"]["aux_bytes"].get<int64_t>() +
                j["flashinfer"]["dispatch_region_bytes"].get<int64_t>() +
                j["flashinfer"]["combine_region_bytes"].get<int64_t>(),
            3769368960);
  // The allocation's regions: 128-byte aligned, in order, within the total.
  int64_t end = 0;
  for (const auto& r : j["allocated"]["regions"]) {
    const int64_t offset = r["offset_bytes"].get<int64_t>();
    EXPECT_EQ(offset % 128, 0) << r["name"];
    EXPECT_GE(offset, end) << r["name"];
    end = offset + r["size_bytes"].get<int64_t>();
  }
  EXPECT_LE(end, j["allocated"]["total_bytes"].get<int64_t>());
  EXPECT_GT(j["allocated"]["regions"].size(), 0u);

  WorkspaceCommandOptions small;
  small.model = "tiny-moe";  // H 128, K 2
  small.ep_size = 2;
  small.max_tokens = 3;
  small.json = true;
  std::ostringstream small_out;
  ASSERT_TRUE(RunWorkspaceCommand(small, small_out).ok());
  const nlohmann::json sj = nlohmann::json::parse(small_out.str());
  EXPECT_EQ(sj["dispatch_bytes_per_token"], 2 * 128 + 8 * 2);
}

TEST(RunPlanCommand, JsonListsEveryLayer) {
  PlanCommandOptions o;
  o.model = "tiny-moe";  // layer 0 dense, 1..3 sparse
  o.tp_size = 4;
  o.attn_dp_size = 2;
  o.moe_dense_tp_size = 1;
  o.json = true;
  std::ostringstream out;
  ASSERT_TRUE(RunPlanCommand(o, out).ok());
  const nlohmann::json j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["model"], "tiny-moe");
  EXPECT_EQ(j["num_layers"], 4);
  EXPECT_EQ(j["num_sparse_layers"], 3);
  EXPECT_EQ(j["tp"], 4);
  EXPECT_EQ(j["attn_dp"], 2);
  EXPECT_EQ(j["attn_tp"], 2);
  EXPECT_EQ(j["moe_dense_tp"], 1);
  EXPECT_EQ(j["a2a"], true);
  ASSERT_EQ(j["layers"].size(), 4u);
  const std::vector<bool> sparse = {false, true, true, true};
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(j["layers"][l]["layer"], l);
    EXPECT_EQ(j["layers"][l]["sparse"], sparse[l]);
  }
  // Sparse MLPs with a2a and dense MLPs at moe_dense_tp 1 run SCATTERED.
  EXPECT_EQ(j["layers"][1]["mlp"], "SCATTERED");
  EXPECT_EQ(j["layers"][0]["mlp"], "SCATTERED");
  // The fingerprint is the text output's.
  o.json = false;
  std::ostringstream text;
  ASSERT_TRUE(RunPlanCommand(o, text).ok());
  EXPECT_THAT(text.str(), HasSubstr("fingerprint " + j["fingerprint"].get<std::string>()));
}

TEST(WorkerStatusJson, OneObjectPerTargetWithValuesOrTheError) {
  v1::GetStatusResponse s;
  s.set_rank(1);
  s.set_world_size(2);
  s.set_state(v1::WORKER_STATE_ALLOCATED);
  s.set_backend("gloo");
  s.set_workspace_bytes(2048);
  s.set_expert_bytes(4096);
  s.set_geometry_epoch(3);
  s.set_runtime_max_tokens_per_rank(17);
  s.mutable_counters()->set_forwards(5);
  std::vector<absl::StatusOr<v1::GetStatusResponse>> statuses = {
      s, absl::UnauthenticatedError("missing bearer token")};
  ClientSecurityOptions tls;
  tls.tls_ca = "/ca.pem";
  const nlohmann::json j =
      nlohmann::json::parse(WorkerStatusJson({"h:1", "h:2"}, statuses, tls).dump());
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0]["target"], "h:1");
  EXPECT_EQ(j[0]["ok"], true);
  EXPECT_EQ(j[0]["rank"], 1);
  EXPECT_EQ(j[0]["world_size"], 2);
  EXPECT_EQ(j[0]["state"], "ALLOCATED");
  EXPECT_EQ(j[0]["workspace_bytes"], 2048);
  EXPECT_EQ(j[0]["expert_bytes"], 4096);
  EXPECT_EQ(j[0]["geometry_epoch"], 3);
  EXPECT_EQ(j[0]["runtime_max_tokens_per_rank"], 17);
  EXPECT_EQ(j[0]["forwards"], 5);
  EXPECT_EQ(j[1]["target"], "h:2");
  EXPECT_EQ(j[1]["ok"], false);
  EXPECT_EQ(j[1]["state"], "UNAUTHENTICATED");
  EXPECT_EQ(j[1]["code"], "UNAUTHENTICATED");
  EXPECT_EQ(j[1]["error"], "missing bearer token");
  EXPECT_THAT(j[1]["hint"].get<std::string>(), HasSubstr("--auth-token-file"));
}

TEST(RunStatusCommand, BadTargetsAreInvalidArgument) {
  std::ostringstream out;
  EXPECT_EQ(RunStatusCommand("nohost", out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ValidateBenchOptions, RejectsEachBadFlag) {
  EXPECT_TRUE(ValidateBenchOptions({}, 4).ok());
  BenchCommandOptions o;
  o.top_k = 300;
  EXPECT_THAT(ValidateBenchOptions(o, 4).message(), HasSubstr("--top-k"));
  o = {};
  o.num_experts = 2;
  o.top_k = 2;
  EXPECT_THAT(ValidateBenchOptions(o, 4).message(), HasSubstr("number of ranks (4)"));
  o = {};
  o.tokens_per_rank = 0;
  EXPECT_THAT(ValidateBenchOptions(o, 4).message(), HasSubstr("--tokens"));
  o = {};
  o.warmup = -1;
  EXPECT_THAT(ValidateBenchOptions(o, 4).message(), HasSubstr("--warmup"));
  o = {};
  o.routing = "zipf";
  EXPECT_THAT(ValidateBenchOptions(o, 4).message(), HasSubstr("--routing"));
}

TEST(TensorMessage, RoundTripAndValidation) {
  const std::vector<core::bf16_t> values = {1, 2, 3, 4, 5, 6};
  const v1::Tensor t = MakeBf16Tensor(values, 2, 3);
  EXPECT_EQ(t.dtype(), v1::DTYPE_BF16);
  EXPECT_THAT(t.shape(), ::testing::ElementsAre(2, 3));
  EXPECT_EQ(t.data().size(), 12u);
  auto back = ReadBf16Tensor(t, "output", 2, 3);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, values);
  EXPECT_THAT(ReadBf16Tensor(t, "output", 3, 2).status().message(),
              HasSubstr("output.shape: expected [3, 2], got [2, 3]"));
  v1::Tensor short_data = t;
  short_data.mutable_data()->resize(10);
  EXPECT_THAT(ReadBf16Tensor(short_data, "output", 2, 3).status().message(),
              HasSubstr("output.data: expected 12 bytes, got 10"));
  const std::vector<int32_t> ids = {7, -1};
  const v1::Tensor it = MakeInt32Tensor(ids, 1, 2);
  EXPECT_EQ(it.dtype(), v1::DTYPE_INT32);
  EXPECT_EQ(it.data().size(), 8u);
  EXPECT_THAT(ReadBf16Tensor(it, "x", 1, 2).status().message(), HasSubstr("x.dtype"));
  const std::vector<float> w = {0.5f};
  EXPECT_EQ(MakeFp32Tensor(w, 1, 1).dtype(), v1::DTYPE_FP32);
}

TEST(RunPlanCommand, ReportsEachFamilysQuantization) {
  // issue 35 item 1: method, format, block size, modules not converted, and
  // the experts' bytes in the checkpoint's format.
  const std::string v3 = DataDir() + "/models/DeepSeek-V3.json";
  const std::string oss = DataDir() + "/models/gpt-oss-120b.json";
  if (!std::ifstream(v3) || !std::ifstream(oss)) GTEST_SKIP() << "no data dir at " << DataDir();
  PlanCommandOptions o;
  o.model = v3;
  o.json = true;
  std::ostringstream out;
  ASSERT_TRUE(RunPlanCommand(o, out).ok());
  const nlohmann::json q = nlohmann::json::parse(out.str())["quantization"];
  EXPECT_EQ(q["method"], "fp8");
  EXPECT_EQ(q["fmt"], "e4m3");
  EXPECT_EQ(q["weight_block_size"], nlohmann::json::array({128, 128}));
  EXPECT_EQ(q["activation_scheme"], "dynamic");
  EXPECT_EQ(q["expert_format"], "fp8-block128");
  EXPECT_EQ(q["expert_bytes"].get<int64_t>(), 44040192 + 10752);
  EXPECT_EQ(q["layer_expert_bytes"].get<int64_t>(), int64_t{256} * (44040192 + 10752));
  // 58 MoE layers: 0.654 TB of fp8 experts (1.31 TB in bf16).
  EXPECT_EQ(q["model_expert_bytes"].get<int64_t>(), int64_t{58} * 256 * (44040192 + 10752));
  o.json = false;
  std::ostringstream text;
  ASSERT_TRUE(RunPlanCommand(o, text).ok());
  EXPECT_THAT(text.str(), HasSubstr("weights: fp8 (e4m3, 128 x 128 blocks, dynamic activations); "
                                    "routed experts fp8-block128: 42.0 MiB each"));
  EXPECT_THAT(text.str(), HasSubstr("(scales 0.024%)"));

  o.model = oss;
  o.json = true;
  std::ostringstream oss_out;
  ASSERT_TRUE(RunPlanCommand(o, oss_out).ok());
  const nlohmann::json m = nlohmann::json::parse(oss_out.str())["quantization"];
  EXPECT_EQ(m["method"], "mxfp4");
  EXPECT_EQ(m["weight_block_size"], nlohmann::json::array({1, 32}));
  EXPECT_EQ(m["expert_format"], "mxfp4");
  EXPECT_EQ(m["modules_to_not_convert"].size(), 4u);
  EXPECT_EQ(m["expert_bytes"].get<int64_t>(), 13219200 + 17280);

  o.model = "qwen3-30b-a3b";
  std::ostringstream bf16_out;
  ASSERT_TRUE(RunPlanCommand(o, bf16_out).ok());
  const nlohmann::json b = nlohmann::json::parse(bf16_out.str())["quantization"];
  EXPECT_EQ(b["method"], "none");
  EXPECT_EQ(b["expert_format"], "bf16");
  EXPECT_EQ(b["expert_bytes"].get<int64_t>(), 3 * 768 * 2048 * 2);
}

TEST(RunWorkspaceCommand, ExpertWeightsPerRankInTheCheckpointFormat) {
  const std::string v3 = DataDir() + "/models/DeepSeek-V3.json";
  if (!std::ifstream(v3)) GTEST_SKIP() << "no data dir at " << DataDir();
  WorkspaceCommandOptions o;
  o.model = v3;
  o.ep_size = 8;
  o.max_tokens = 128;
  o.json = true;
  std::ostringstream out;
  ASSERT_TRUE(RunWorkspaceCommand(o, out).ok());
  const nlohmann::json e = nlohmann::json::parse(out.str())["expert_weights"];
  EXPECT_EQ(e["format"], "fp8-block128");
  EXPECT_EQ(e["experts_per_rank"], 32);
  EXPECT_EQ(e["num_sparse_layers"], 58);
  // The 82 GB a GPU at EP 8 (163 GB in bf16).
  EXPECT_EQ(e["per_rank_bytes"].get<int64_t>(), int64_t{32} * 58 * (44040192 + 10752));
  o.json = false;
  std::ostringstream text;
  ASSERT_TRUE(RunWorkspaceCommand(o, text).ok());
  EXPECT_THAT(text.str(),
              HasSubstr("routed experts (fp8-block128): 42.0 MiB each (44050944 bytes); 32 a "
                        "rank x 58 MoE layers = 76.1 GiB (81758552064 bytes) a rank"));
}

}  // namespace
}  // namespace moe_ep::client
