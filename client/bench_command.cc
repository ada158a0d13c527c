#include "client/bench_command.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/coordinator.h"
#include "client/group_session.h"
#include "client/text_table.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace moe_ep::client {

absl::Status ValidateBenchOptions(const BenchCommandOptions& o, int world) {
  auto positive = [](const char* flag, int64_t v) {
    return v >= 1 ? absl::OkStatus()
                  : absl::InvalidArgumentError(absl::StrCat(flag, ": expected >= 1, got ", v));
  };
  RETURN_IF_ERROR(positive("--tokens", o.tokens_per_rank));
  RETURN_IF_ERROR(positive("--hidden", o.hidden));
  RETURN_IF_ERROR(positive("--top-k", o.top_k));
  RETURN_IF_ERROR(positive("--num-experts", o.num_experts));
  RETURN_IF_ERROR(positive("--iterations", o.iterations));
  if (o.warmup < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--warmup: expected >= 0, got ", o.warmup));
  }
  if (o.top_k > o.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("--top-k: expected <= --num-experts (", o.num_experts, "), got ", o.top_k));
  }
  if (world > 0 && o.num_experts < world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num-experts: expected >= the number of ranks (", world, "), got ", o.num_experts));
  }
  if (o.routing != "uniform" && o.routing != "skewed") {
    return absl::InvalidArgumentError(
        absl::StrCat("--routing: expected uniform or skewed, got '", o.routing, "'"));
  }
  return absl::OkStatus();
}

absl::Status RunBenchCommand(const BenchCommandOptions& options, std::ostream& out) {
  RETURN_IF_ERROR(ValidateBenchOptions(options, 0));
  ASSIGN_OR_RETURN(AttachedWorkers workers, AttachWorkers(options.workers));
  const int world = static_cast<int>(workers.targets.size());
  RETURN_IF_ERROR(ValidateBenchOptions(options, world));
  ASSIGN_OR_RETURN(GroupSession group, FormWorkerGroup(workers));
  Coordinator* const coordinator = group.coordinator.get();

  // A one-layer MoE model of the benchmark's sizes.
  v1::ConfigureLayersRequest configure;
  configure.mutable_layout()->set_tp_size(world);
  configure.mutable_layout()->set_attn_dp_size(world);
  configure.mutable_layout()->set_moe_dense_tp_size(1);
  configure.set_a2a_enabled(true);
  v1::ModelDescription* md = configure.mutable_model();
  md->set_name("bench");
  md->set_hidden_size(options.hidden);
  md->set_num_layers(1);
  md->set_num_experts(options.num_experts);
  md->set_top_k(options.top_k);
  md->set_moe_intermediate_size(options.hidden);
  md->add_sparse_layers(true);
  RETURN_IF_ERROR(coordinator->ConfigureLayers(configure).status());
  v1::AllocateWorkspaceRequest allocate;
  allocate.set_hidden_size(options.hidden);
  allocate.set_top_k(options.top_k);
  allocate.set_num_experts(options.num_experts);
  allocate.set_capacity_tokens(options.tokens_per_rank);
  allocate.set_dispatch_dtype(v1::DISPATCH_DTYPE_BF16);
  RETURN_IF_ERROR(coordinator->AllocateWorkspace(allocate).status());

  v1::BenchmarkRequest request;
  request.set_tokens_per_rank(options.tokens_per_rank);
  request.set_hidden_size(options.hidden);
  request.set_top_k(options.top_k);
  request.set_num_experts(options.num_experts);
  request.set_routing(options.routing);
  request.set_iterations(options.iterations);
  request.set_warmup(options.warmup);
  request.set_seed(options.seed);
  ASSIGN_OR_RETURN(std::vector<v1::BenchmarkResponse> results, coordinator->Benchmark(request));
  if (options.json) {
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < world; ++r) {
      const v1::BenchmarkResponse& b = results[r];
      ranks.push_back({{"rank", r},
                       {"dispatch_p50_us", b.dispatch_p50_us()},
                       {"dispatch_p99_us", b.dispatch_p99_us()},
                       {"combine_p50_us", b.combine_p50_us()},
                       {"combine_p99_us", b.combine_p99_us()},
                       {"dispatch_bytes", b.dispatch_bytes()},
                       {"combine_bytes", b.combine_bytes()},
                       {"dispatch_logical_gbps", b.dispatch_logical_gbps()},
                       {"combine_logical_gbps", b.combine_logical_gbps()}});
    }
    const nlohmann::json j = {{"world", world},
                              {"backend", group.joined[0].backend()},
                              {"tokens_per_rank", options.tokens_per_rank},
                              {"hidden", options.hidden},
                              {"top_k", options.top_k},
                              {"num_experts", options.num_experts},
                              {"routing", options.routing},
                              {"iterations", options.iterations},
                              {"warmup", options.warmup},
                              {"seed", options.seed},
                              {"ranks", std::move(ranks)}};
    out << j.dump(2) << "\n";
    return absl::OkStatus();
  }

  out << "bench: " << world << " ranks (backend " << group.joined[0].backend() << "), "
      << options.tokens_per_rank << " tokens/rank, hidden " << options.hidden << ", top-"
      << options.top_k << ", " << options.num_experts << " experts, " << options.routing
      << " routing, " << options.iterations << " iterations after " << options.warmup
      << " warm-up\n";
  TextTable table({"rank", "dispatch p50", "dispatch p99", "combine p50", "combine p99",
                   "dispatch bytes", "combine bytes", "dispatch GB/s", "combine GB/s"});
  for (int r = 0; r < world; ++r) {
    const v1::BenchmarkResponse& b = results[r];
    table.AddRow({absl::StrCat(r), absl::StrFormat("%.1f us", b.dispatch_p50_us()),
                  absl::StrFormat("%.1f us", b.dispatch_p99_us()),
                  absl::StrFormat("%.1f us", b.combine_p50_us()),
                  absl::StrFormat("%.1f us", b.combine_p99_us()),
                  FormatBytes(static_cast<double>(b.dispatch_bytes())),
                  FormatBytes(static_cast<double>(b.combine_bytes())),
                  absl::StrFormat("%.2f", b.dispatch_logical_gbps()),
                  absl::StrFormat("%.2f", b.combine_logical_gbps())});
  }
  out << table.Render() << "GB/s is logical: payload bytes including the local share, over time "
      << "(DESIGN §10)\n";
  return absl::OkStatus();
}

}  // namespace moe_ep::client
