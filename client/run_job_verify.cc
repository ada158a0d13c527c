// Step 8 of `moe-ep run` (client/run_job_steps.h): every run layer against
// the single-process reference, one chunk of one layer's experts in memory
// at a time.

#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "client/run_job_steps.h"
#include "client/streamed_reference.h"
#include "client/tolerance.h"
#include "core/dispatch_rounding.h"
#include "core/expert_source.h"
#include "core/experts.h"
#include "core/shared_expert.h"
#include "core/status_macros.h"

namespace moe_ep::client::run_job_internal {
namespace {

// All (step, rank) rows of one run layer, step-major and rank-minor.
struct LayerRows {
  int64_t total = 0;
  std::vector<core::bf16_t> xs;  // [total, H]
  std::vector<int32_t> ids;      // [total, K]
  std::vector<float> ws;         // [total, K]
};

LayerRows GatherLayerRows(const RunJobOptions& options, const RunJobState& job, int li) {
  const int64_t H = job.model.hidden_size;
  const int K = job.model.top_k;
  LayerRows rows;
  for (int s = 0; s < options.steps; ++s) {
    for (int r = 0; r < job.world; ++r) rows.total += job.record[li][s][r].num_tokens;
  }
  rows.xs.reserve(rows.total * H);
  rows.ids.reserve(rows.total * K);
  rows.ws.reserve(rows.total * K);
  for (int s = 0; s < options.steps; ++s) {
    for (int r = 0; r < job.world; ++r) {
      const RankStep& rs = job.record[li][s][r];
      rows.xs.insert(rows.xs.end(), rs.input.begin(), rs.input.end());
      rows.ids.insert(rows.ids.end(), rs.ids.begin(), rs.ids.end());
      rows.ws.insert(rows.ws.end(), rs.weights.begin(), rs.weights.end());
    }
  }
  return rows;
}

// The reference of `rows` of model layer `layer` in fp32 [total, H]: the
// routed experts a chunk at a time (one GEMM per expert) plus the shared
// expert; *chunks counts the chunks made and skipped.
absl::StatusOr<std::vector<float>> LayerReference(const RunJobOptions& options,
                                                  const RunJobState& job, int layer,
                                                  const LayerRows& rows,
                                                  StreamedReferenceStats* chunks) {
  const core::ModelDescription& model = job.model;
  const int64_t H = model.hidden_size;
  const ExpertChunkFactory make_chunk = [&](int first,
                                            int count) -> absl::StatusOr<core::ExpertSet> {
    if (job.identity) return core::ExpertSet::Identity(first, count, H);
    core::ExpertSource source = core::ExpertSource::Seeded(
        options.seed, layer, model.num_experts, first, count, H, model.moe_intermediate_size);
    source.weight_format = job.format;
    if (model.swiglu_limit > 0) {
      source.gpt_oss_activation.limit = static_cast<float>(model.swiglu_limit);
    }
    if (job.scale_input) source.router_weight_use = core::RouterWeightUse::kScalesInput;
    return core::MakeHostExperts(source);
  };
  std::vector<float> ref(rows.total * H);
  // The routed experts read the rows as dispatched (fp8_e4m3: the e4m3
  // rounding of every data plane); the shared expert the input itself.
  ASSIGN_OR_RETURN(std::vector<core::bf16_t> dispatched,
                   core::DispatchedHidden(options.dispatch_dtype, rows.xs, rows.total, H));
  ASSIGN_OR_RETURN(*chunks,
                   StreamedMoeReference(make_chunk, model.num_experts,
                                        job.memory.reference_chunk_experts, H, dispatched, rows.ids,
                                        rows.ws, rows.total, model.top_k, absl::MakeSpan(ref)));
  const core::SharedExpertConfig& shared = model.shared_expert;
  if (shared.present()) {
    // The shared expert of every row, added to the routed reference in fp32.
    ASSIGN_OR_RETURN(
        core::SharedExpert shared_expert,
        job.identity ? core::SharedExpert::Identity(options.seed, layer, H, shared.sigmoid_gate)
                     : core::SharedExpert::Generate(options.seed, layer, H,
                                                    shared.intermediate_size, shared.sigmoid_gate));
    std::vector<float> shared_ref(rows.total * H);
    RETURN_IF_ERROR(shared_expert.ComputeFloat(rows.xs, rows.total, absl::MakeSpan(shared_ref)));
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += shared_ref[i];
  }
  return ref;
}

// Each (step, rank) output of run layer li against its rows of `ref`,
// merged into the layer's comparison; a line per failing one.
absl::Status CompareLayer(const RunJobOptions& options, RunJobState& job, int li,
                          absl::Span<const float> ref, std::ostream& out) {
  const int64_t H = job.model.hidden_size;
  const int layer = job.run_layers[li];
  LayerRunSummary& summary = job.result.layers[li];
  int64_t offset = 0;
  for (int s = 0; s < options.steps; ++s) {
    for (int r = 0; r < job.world; ++r) {
      const RankStep& rs = job.record[li][s][r];
      ASSIGN_OR_RETURN(Comparison c,
                       CompareToReference(rs.output, ref.subspan(offset * H, rs.num_tokens * H),
                                          options.tolerance));
      if (!c.pass) {
        out << absl::StrFormat(
            "  layer %d step %d rank %d: max abs err %.3g at token %d, element %d (bound %.3g)\n",
            layer, s + 1, r, c.max_abs_err, c.worst_index / H, c.worst_index % H, c.bound);
      }
      MergeComparison(c, options.tolerance, &summary.comparison);
      offset += rs.num_tokens;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status VerifyRunLayers(const RunJobOptions& options, RunJobState& job, std::ostream& out) {
  for (int li = 0; li < options.num_layers; ++li) {
    const int layer = job.run_layers[li];
    const absl::Time start = absl::Now();
    const LayerRows rows = GatherLayerRows(options, job, li);
    StreamedReferenceStats chunks;
    ASSIGN_OR_RETURN(std::vector<float> ref, LayerReference(options, job, layer, rows, &chunks));
    job.result.reference_chunks_made += chunks.chunks_made;
    job.result.reference_chunks_skipped += chunks.chunks_skipped;
    RETURN_IF_ERROR(CompareLayer(options, job, li, ref, out));
    const Comparison& comparison = job.result.layers[li].comparison;
    out << absl::StrFormat(
        "verify: layer %d against the single-process reference (%d experts in %d chunk(s) of "
        "<= %d, %d skipped as unselected%s; %d rows) in %.1f s: max abs err %.3g, bound %.3g: "
        "%s\n",
        layer, job.model.num_experts, chunks.chunks_made, job.memory.reference_chunk_experts,
        chunks.chunks_skipped, job.model.shared_expert.present() ? ", + shared expert" : "",
        rows.total, absl::ToDoubleSeconds(absl::Now() - start), comparison.max_abs_err,
        comparison.bound, comparison.pass ? "PASS" : "FAIL");
    out.flush();
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::client::run_job_internal
