#pragma once

// Per-step routing (top-k expert ids and weights) for runs and benchmarks of
// moe-ep when no model produces it: synthetic distributions and replays of
// real routing. Every result is a pure function of the source's options and
// (layer, step, rank, world), so all ranks, runs and machines agree.
//
// Kinds (RoutingSourceOptions::kind):
//   "uniform"     each token's K experts uniformly at random, distinct.
//   "skewed"      Zipf-like popularity: the expert at popularity position p
//   "skewed:S"    (0-based) has weight 1 / (p + 1)^S (S = zipf_exponent, or
//                 the number after the colon); positions are a seeded
//                 permutation of the experts, different per layer.
//   "load:FILE"   expert popularity from a per-layer load matrix
//                 {"logical_count": [[float x N_f] x L_f]} such as SGLang's
//                 EPLB statistics of DeepSeek-V3 (../shared/data/traces/
//                 sglang_ep_statistics_deepseek/*.json).
//   "trace:FILE"  replay of logged routing: a JSON-lines file whose records
//                 {"type":"route","token_idx":i,"topk_ids":[..],
//                 "topk_weights":[..]} form forward steps (token_idx restarts
//                 at 0 at each step); an optional first {"type":"meta"} record
//                 may give "top_k" and "num_experts". E.g. the Qwen1.5-MoE
//                 vLLM log (../shared/data/traces/qwen15moe_vllm_topk_routes.jsonl:
//                 105 steps, 60 experts, top-4).
//
// Sampling (uniform, skewed, load): a token's K experts are drawn one after
// another without replacement, each draw proportional to the weights of the
// experts not yet drawn (so the first id of a token follows the popularity
// exactly). Experts with weight 0 are never drawn. Router weights are the
// softmax of K standard Gumbel logits sorted in descending order, assigned in
// draw order: they sum to 1 and descend along k, as a top-k router's do.
//
// Mapping onto the model being run (num_experts M, top_k K):
//   layers:  "load" uses file layer `layer` when it exists and has nonzero
//            load (so DeepSeek-V3 layer indices map one to one), otherwise
//            the (layer mod n)-th of the file's n nonzero layers. "trace" is
//            one layer's routing (the log's layer label is unreliable); layer
//            0 replays it as logged and layer l > 0 renames experts through a
//            seeded permutation of [0, M) for layer l.
//   experts: "load" with N_f file experts: M == N_f as is; M < N_f sums the
//            load of file experts e with floor(e * M / N_f) == m into model
//            expert m; M > N_f splits file expert e's load evenly over the
//            model experts m with floor(m * N_f / M) == e. "trace" with N_t
//            experts: M >= N_t maps e to floor(e * M / N_t) (injective);
//            M < N_t maps e to e mod M, moving a collision within a token to
//            the next free id.
//   top-k:   "trace" keeps the first K of the logged top-K_t ids (the logged
//            order is by descending weight) and renormalises their weights to
//            sum 1; K > K_t is an error.
//   tokens:  "trace" prescribes each step's token count; TokensPerRank splits
//            it over ranks as DP attention would (contiguous blocks, the first
//            n mod world ranks one token more). Rank r's token j is logged
//            token (offset_r + j) mod n of the step, so asking for another
//            count cycles through the step's tokens. Step s replays logged
//            step s mod num_steps().
//
// Thread-safe after Create (all methods are const).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe_ep::core {

struct RoutingSourceOptions {
  std::string kind = "uniform";  // see above
  int num_experts = 0;           // M, routed experts of the model being run
  int top_k = 0;                 // K
  uint64_t seed = 0;
  double zipf_exponent = 1.0;  // "skewed" without an explicit ":S"
};

// One step's routing on one rank.
struct Routing {
  int64_t num_tokens = 0;           // T
  int top_k = 0;                    // K
  std::vector<int32_t> topk_ids;    // [T, K], distinct per token, in [0, M)
  std::vector<float> topk_weights;  // [T, K], each row sums to 1, descending
};

class RoutingSource {
 public:
  // Errors: kInvalidArgument (unknown kind, M < 1, K < 1, K > M, exponent
  // negative or not finite, a load layer with load on fewer than K (mapped)
  // experts, a trace with top-K_t < K; messages give the numbers),
  // kNotFound (FILE missing), kDataLoss (FILE malformed: not JSON, wrong
  // shape, a record without ids/weights or with a repeated id, token_idx out
  // of sequence; the message names the line).
  static absl::StatusOr<RoutingSource> Create(const RoutingSourceOptions& options);

  // Writes the routing of `num_tokens` tokens of rank `rank` of `world` for
  // (layer, step) into topk_ids [T, K] and topk_weights [T, K].
  // Errors: kInvalidArgument for layer < 0, step < 0, rank outside
  // [0, world), num_tokens < 0, or span sizes != T * K.
  absl::Status Generate(int layer, int64_t step, int rank, int world, int64_t num_tokens,
                        absl::Span<int32_t> topk_ids, absl::Span<float> topk_weights) const;
  // Same, allocating the result.
  absl::StatusOr<Routing> Generate(int layer, int64_t step, int rank, int world,
                                   int64_t num_tokens) const;

  // True for "trace": the source prescribes how many tokens each rank has.
  bool prescribes_token_counts() const { return !trace_steps_.empty(); }
  // For "trace": tokens of step `step` (mod num_steps()) on each of `world`
  // ranks (DP attention split, see above). Empty for the other kinds, or when
  // world < 1.
  std::vector<int64_t> TokensPerRank(int64_t step, int world) const;
  // Number of logged steps ("trace"), 0 otherwise.
  int64_t num_steps() const { return static_cast<int64_t>(trace_steps_.size()); }

  const RoutingSourceOptions& options() const { return options_; }

 private:
  enum class Kind { kUniform, kSkewed, kLoad, kTrace };
  struct TraceStep {
    int64_t num_tokens = 0;
    std::vector<int32_t> ids;    // [n, K_t]
    std::vector<float> weights;  // [n, K_t]
  };

  std::vector<double> LayerWeights(int layer) const;  // [M] popularity of one layer
  void GenerateTrace(int layer, int64_t step, int rank, int world, int64_t num_tokens,
                     absl::Span<int32_t> ids, absl::Span<float> weights) const;

  RoutingSourceOptions options_;
  Kind kind_ = Kind::kUniform;
  double exponent_ = 1.0;
  // "load": model-expert weights [M] per file layer; nonzero layers.
  std::vector<std::vector<double>> load_weights_;
  std::vector<int> load_nonzero_layers_;
  // "trace"
  std::vector<TraceStep> trace_steps_;
  int trace_top_k_ = 0;
  int trace_num_experts_ = 0;
};

}  // namespace moe_ep::core
