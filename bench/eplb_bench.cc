// Expert load balance of the contiguous placement against EPLB (DESIGN §15,
// issue 17): for each load file ({"logical_count": [[count x E] x L]}, e.g.
// SGLang's DeepSeek-V3 statistics in ../shared/data/traces/
// sglang_ep_statistics_deepseek), prints per MoE layer the max/mean tokens
// per rank of the contiguous placement, of RebalanceHierarchical() and of
// RebalanceGreedy(), then the worst layer of each per file. Layers with no
// load (dense layers) are skipped. Tokens per rank: core/placement_load.h.
//
//   moe_ep_eplb_bench [--ep-size 8] [--num-slots 288] [--num-groups 1]
//                     [--num-nodes 1] [--summary-only] FILE...

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <numeric>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "core/eplb.h"
#include "core/expert_load_file.h"
#include "core/placement_load.h"
#include "core/placement_table.h"

namespace {

using moe_ep::core::PlacementTable;

// Max/mean of `table` under `load`; exits on a library error (bad input).
double Ratio(const absl::StatusOr<PlacementTable>& table, const std::vector<double>& load) {
  if (!table.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(table.status().message()).c_str());
    std::exit(1);
  }
  auto loads = moe_ep::core::RankLoads(*table, load);
  auto ratio = loads.ok() ? moe_ep::core::MaxOverMean(*loads) : loads.status();
  if (!ratio.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(ratio.status().message()).c_str());
    std::exit(1);
  }
  return *ratio;
}

// The program; main() below only adds the last-resort catch.
int Main(int argc, char** argv) {
  CLI::App app{"Max/mean tokens per rank: contiguous placement vs EPLB vs greedy"};
  std::vector<std::string> files;
  moe_ep::core::EplbOptions options{288, 8, 1, 1};
  bool summary_only = false;
  app.add_option("files", files, "load files {\"logical_count\": [[count x E] x L]}")->required();
  app.add_option("--ep-size", options.ep_size, "EP ranks")->capture_default_str();
  app.add_option("--num-slots", options.num_slots, "physical slots over all ranks")
      ->capture_default_str();
  app.add_option("--num-groups", options.num_groups, "expert groups (EPLB hierarchy)")
      ->capture_default_str();
  app.add_option("--num-nodes", options.num_nodes, "nodes (EPLB hierarchy)")->capture_default_str();
  app.add_flag("--summary-only", summary_only, "print only the per-file worst layers");
  CLI11_PARSE(app, argc, argv);

  std::printf("ep_size %d, num_slots %d, num_groups %d, num_nodes %d\n", options.ep_size,
              options.num_slots, options.num_groups, options.num_nodes);
  std::vector<std::string> summary;
  double all_eplb = 0, all_greedy = 0, all_contiguous = 0;
  for (const std::string& file : files) {
    auto rows = moe_ep::core::ReadExpertLoadFile(file);
    if (!rows.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(rows.status().message()).c_str());
      return 1;
    }
    const int num_experts = static_cast<int>((*rows)[0].size());
    const auto contiguous = PlacementTable::Contiguous(num_experts, options.ep_size);
    double worst_contiguous = 0, worst_eplb = 0, worst_greedy = 0;
    int worst_layer = -1, moe_layers = 0;
    if (!summary_only) std::printf("# %s\n# layer contiguous eplb greedy\n", file.c_str());
    for (size_t layer = 0; layer < rows->size(); ++layer) {
      const std::vector<double>& load = (*rows)[layer];
      if (std::accumulate(load.begin(), load.end(), 0.0) == 0) continue;
      ++moe_layers;
      const double c = Ratio(contiguous, load);
      const double e = Ratio(moe_ep::core::RebalanceHierarchical(load, options), load);
      const double g =
          Ratio(moe_ep::core::RebalanceGreedy(load, options.num_slots, options.ep_size), load);
      if (!summary_only) std::printf("  %3zu %8.4f %8.5f %8.5f\n", layer, c, e, g);
      if (c > worst_contiguous) {
        worst_contiguous = c;
        worst_layer = static_cast<int>(layer);
      }
      worst_eplb = std::max(worst_eplb, e);
      worst_greedy = std::max(worst_greedy, g);
    }
    const std::string name = file.substr(file.find_last_of('/') + 1);
    char line[160];
    std::snprintf(line, sizeof(line), "%-28s %10d %11.4f %9d %10.5f %10.5f", name.c_str(),
                  moe_layers, worst_contiguous, worst_layer, worst_eplb, worst_greedy);
    summary.push_back(line);
    all_contiguous = std::max(all_contiguous, worst_contiguous);
    all_eplb = std::max(all_eplb, worst_eplb);
    all_greedy = std::max(all_greedy, worst_greedy);
  }
  std::printf("%-28s %10s %11s %9s %10s %10s\n", "file", "moe_layers", "contig_max", "at_layer",
              "eplb_max", "greedy_max");
  for (const std::string& line : summary) std::printf("%s\n", line.c_str());
  std::printf("%-28s %10s %11.4f %9s %10.5f %10.5f\n", "all files", "", all_contiguous, "",
              all_eplb, all_greedy);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "eplb_bench: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "eplb_bench: error: an exception that is not a std::exception\n");
  }
  return 1;
}
