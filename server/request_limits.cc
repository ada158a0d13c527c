#include "server/request_limits.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/status_macros.h"

namespace moe_ep::server {
namespace {

absl::Status AtMost(absl::string_view field, int64_t value, int64_t limit, absl::string_view flag) {
  if (value > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected <= ", limit, " (--", flag, "), got ", value));
  }
  return absl::OkStatus();
}

// The first dimension of a tensor (rows), when it has one.
absl::Status RowsAtMost(absl::string_view field, const v1::Tensor& tensor, int64_t limit) {
  if (tensor.shape_size() == 0) return absl::OkStatus();
  return AtMost(absl::StrCat(field, ".shape[0]"), tensor.shape(0), limit, "max-tokens");
}

absl::Status CheckModel(const RequestLimits& limits, const v1::ModelDescription& model,
                        absl::string_view prefix) {
  RETURN_IF_ERROR(AtMost(absl::StrCat(prefix, "num_layers"), model.num_layers(), limits.max_layers,
                         "max-layers"));
  RETURN_IF_ERROR(AtMost(absl::StrCat(prefix, "num_experts"), model.num_experts(),
                         limits.max_experts, "max-experts"));
  RETURN_IF_ERROR(
      AtMost(absl::StrCat(prefix, "top_k"), model.top_k(), limits.max_top_k, "max-top-k"));
  RETURN_IF_ERROR(AtMost(absl::StrCat(prefix, "hidden_size"), model.hidden_size(),
                         limits.max_hidden, "max-hidden"));
  return AtMost(absl::StrCat(prefix, "moe_intermediate_size"), model.moe_intermediate_size(),
                limits.max_hidden, "max-hidden");
}

// Cuts `text` to at most `max` bytes without splitting a UTF-8 sequence.
size_t Utf8Cut(absl::string_view text, size_t max) {
  size_t cut = std::min(max, text.size());
  while (cut > 0 && cut < text.size() && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) {
    --cut;
  }
  return cut;
}

}  // namespace

absl::Status CheckJoin(const RequestLimits& limits, const v1::JoinRequest& request) {
  RETURN_IF_ERROR(
      AtMost("world_size", request.world_size(), limits.max_world_size, "max-world-size"));
  // The generation's bound depends on what this worker saw: CheckJoin of
  // server/group_formation.h.
  return AtMost("timeout_ms", request.timeout_ms(), limits.max_timeout_ms, "max-timeout-ms");
}

absl::Status CheckConfigureLayers(const RequestLimits& limits,
                                  const v1::ConfigureLayersRequest& request) {
  RETURN_IF_ERROR(AtMost("layout.tp_size", request.layout().tp_size(), limits.max_world_size,
                         "max-world-size"));
  return CheckModel(limits, request.model(), "model.");
}

absl::Status CheckAllocateWorkspace(const RequestLimits& limits,
                                    const v1::AllocateWorkspaceRequest& request) {
  RETURN_IF_ERROR(AtMost("hidden_size", request.hidden_size(), limits.max_hidden, "max-hidden"));
  RETURN_IF_ERROR(AtMost("top_k", request.top_k(), limits.max_top_k, "max-top-k"));
  RETURN_IF_ERROR(AtMost("num_experts", request.num_experts(), limits.max_experts, "max-experts"));
  RETURN_IF_ERROR(
      AtMost("capacity_tokens", request.capacity_tokens(), limits.max_tokens, "max-tokens"));
  RETURN_IF_ERROR(AtMost("chunked_prefill_size", request.chunked_prefill_size(), limits.max_tokens,
                         "max-tokens"));
  for (int i = 0; i < request.cuda_graph_buckets_size(); ++i) {
    RETURN_IF_ERROR(AtMost(absl::StrCat("cuda_graph_buckets[", i, "]"),
                           request.cuda_graph_buckets(i), limits.max_tokens, "max-tokens"));
  }
  return absl::OkStatus();
}

absl::Status CheckLoadExperts(const RequestLimits& limits, const v1::LoadExpertsRequest& request) {
  RETURN_IF_ERROR(AtMost("layer", request.layer(), limits.max_layers, "max-layers"));
  return AtMost("intermediate_size", request.intermediate_size(), limits.max_hidden, "max-hidden");
}

absl::Status CheckForward(const RequestLimits& limits, const v1::ForwardRequest& request) {
  RETURN_IF_ERROR(AtMost("layer", request.layer(), limits.max_layers, "max-layers"));
  RETURN_IF_ERROR(RowsAtMost("hidden_states", request.hidden_states(), limits.max_tokens));
  RETURN_IF_ERROR(RowsAtMost("topk_ids", request.topk_ids(), limits.max_tokens));
  return RowsAtMost("topk_weights", request.topk_weights(), limits.max_tokens);
}

absl::Status CheckBenchmark(const RequestLimits& limits, const v1::BenchmarkRequest& request) {
  RETURN_IF_ERROR(
      AtMost("tokens_per_rank", request.tokens_per_rank(), limits.max_tokens, "max-tokens"));
  RETURN_IF_ERROR(AtMost("hidden_size", request.hidden_size(), limits.max_hidden, "max-hidden"));
  RETURN_IF_ERROR(AtMost("top_k", request.top_k(), limits.max_top_k, "max-top-k"));
  RETURN_IF_ERROR(AtMost("num_experts", request.num_experts(), limits.max_experts, "max-experts"));
  RETURN_IF_ERROR(
      AtMost("iterations", request.iterations(), limits.max_iterations, "max-iterations"));
  RETURN_IF_ERROR(AtMost("warmup", request.warmup(), limits.max_iterations, "max-iterations"));
  // Each factor is bounded above and may be negative (rejected later).
  if (request.tokens_per_rank() > 0 && request.top_k() > 0 && request.num_experts() > 0) {
    const int64_t draws = request.tokens_per_rank() * request.top_k() * request.num_experts();
    if (draws > limits.max_benchmark_draws) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokens_per_rank * top_k * num_experts: expected <= ", limits.max_benchmark_draws,
          " (--max-benchmark-draws: the routing sampler's work), got ", draws));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckForwardLayers(const RequestLimits& limits,
                                const v1::ForwardLayersRequest& request) {
  const v1::LayerStackSpec& stack = request.stack();
  RETURN_IF_ERROR(AtMost("stack.num_layers", stack.num_layers(), limits.max_layers, "max-layers"));
  RETURN_IF_ERROR(
      AtMost("stack.hidden_size", stack.hidden_size(), limits.max_hidden, "max-hidden"));
  RETURN_IF_ERROR(AtMost("stack.dense_intermediate_size", stack.dense_intermediate_size(),
                         limits.max_hidden, "max-hidden"));
  RETURN_IF_ERROR(AtMost("stack.moe_intermediate_size", stack.moe_intermediate_size(),
                         limits.max_hidden, "max-hidden"));
  RETURN_IF_ERROR(
      AtMost("stack.num_experts", stack.num_experts(), limits.max_experts, "max-experts"));
  RETURN_IF_ERROR(AtMost("stack.top_k", stack.top_k(), limits.max_top_k, "max-top-k"));
  RETURN_IF_ERROR(
      AtMost("stack.capacity_tokens", stack.capacity_tokens(), limits.max_tokens, "max-tokens"));
  return RowsAtMost("tokens", request.tokens(), limits.max_tokens);
}

absl::Status CapMessage(const absl::Status& status) {
  if (status.ok() || status.message().size() <= kMaxErrorMessageBytes) return status;
  const absl::string_view message = status.message();
  const size_t keep = Utf8Cut(message, kMaxErrorMessageBytes);
  return absl::Status(status.code(), absl::StrCat(message.substr(0, keep), " ... (",
                                                  message.size() - keep, " bytes cut)"));
}

absl::Status RunGuarded(const char* rpc, const std::function<absl::Status()>& handler) {
  try {
    return handler();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        rpc,
        ": an allocation the request sized failed (out of memory); ask for less, or give "
        "the worker a --memory-cap-bytes it can hold"));
  } catch (const std::length_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat(rpc, ": the request asks for a buffer larger than this worker can address (",
                     e.what(), ")"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(rpc, ": unexpected error: ", e.what()));
  }
}

}  // namespace moe_ep::server
