#pragma once

// The single-process reference of one MoE layer with the layer's experts made
// a chunk at a time, for `moe-ep run`'s verification of models whose layer
// does not fit in memory at once (DeepSeek-V3: 256 experts x 84 MiB = 21 GiB
// per layer; Kimi-K2: 31.5 GiB).
//
// Same result as core::DenseMoeReference with all experts held: experts are
// visited in ascending id order and each adds w * expert(x) into the fp32
// output exactly as DenseMoeReference does, so the output is bit-identical;
// only the number of experts in memory differs (one chunk). Chunks that no
// token selects are never made.

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/experts.h"

namespace moe_ep::client {

// Makes experts [first_expert, first_expert + num_experts) of the layer, e.g.
// core::ExpertSet::GenerateSwiGlu(seed, layer, first_expert, num_experts, H, I).
using ExpertChunkFactory =
    std::function<absl::StatusOr<core::ExpertSet>(int first_expert, int num_experts)>;

struct StreamedReferenceStats {
  int chunks_made = 0;          // chunks some token selects
  int chunks_skipped = 0;       // chunks no token selects (never made)
  int64_t max_chunk_bytes = 0;  // largest ExpertSet::weight_bytes() held at once
  int blas_threads = 0;         // openblas_get_num_threads() for the GEMMs
};

// StreamedMoeReference()
//
// out[t, :] = sum over k with 0 <= topk_ids[t, k] < num_experts of
// topk_weights[t, k] * expert_{topk_ids[t,k]}(hidden_states[t, :]), fp32,
// with experts made by `make_chunk` in chunks [c, c + chunk_experts) (the
// last one shorter), one chunk alive at a time. hidden_states [T, H] bf16,
// topk_ids [T, K] int32, topk_weights [T, K] fp32, out [T, H] fp32
// (overwritten). Ids outside [0, num_experts) contribute nothing.
//
// Errors:
//   kInvalidArgument  num_experts, chunk_experts, hidden or K < 1; T < 0; a
//                     span size differs from its shape (names the span).
//   kInternal         `make_chunk` returned a set other than the one asked
//                     for (first expert, count or H differ; names both).
//   any error of `make_chunk`, unchanged.
//
// Time goes to making experts and to ExpertSet::Apply (widen to fp32, two
// sgemm). Both use all cores: core::ExpertSet::GenerateSwiGlu generates a
// chunk on all cores, Apply widens on all cores into one scratch buffer
// reused for every expert (no per-expert page faults), and OpenBLAS (pthread
// build) runs each sgemm on its own threads, all cores unless
// OPENBLAS_NUM_THREADS says otherwise (reported in blas_threads).
//
// Thread-compatible. Source: issue 2 (every published config on one machine);
// accumulation order of core/moe_reference.cc.
// Example: 10 experts, chunk 4, ids only in {1, 2, 9}: chunks [0, 4) and
// [8, 10) are made, [4, 8) is skipped.
absl::StatusOr<StreamedReferenceStats> StreamedMoeReference(
    const ExpertChunkFactory& make_chunk, int num_experts, int chunk_experts, int64_t hidden,
    absl::Span<const core::bf16_t> hidden_states, absl::Span<const int32_t> topk_ids,
    absl::Span<const float> topk_weights, int64_t num_tokens, int top_k, absl::Span<float> out);

}  // namespace moe_ep::client
