// expert_bench: the SwiGLU expert compute of one EP rank on one GPU
// (kernels/expert_compute.h), every expert local (EP 1), per GEMM path:
//   hopper  ExpertGemm::kGroupedDevice on an sm_90 device (wgmma + TMA,
//           kernels/hopper_grouped_gemm.cuh), replayed from a CUDA graph;
//   wmma    ExpertGemm::kGroupedWmma (the earlier grouped kernels), graph;
//   cublas  ExpertGemm::kCublasHostCounts, eager (host counts: not capturable).
// Each time is the p50 over --iters (CUDA events around one Run or one graph
// replay, after --warmup). The step is the whole ExpertCompute::Run: group
// entries by expert, gather rows, gate_up + SiLU*up, down, weighted sum.
// Routing: every token picks top_k distinct experts uniformly (as
// ../shared/tools/anchors/expert_gemm_torch.py). Also printed: the
// weight-streaming bound (bytes of the experts that got rows / --bound-tbps)
// and the matrix bound (rows * 6 H I FLOP / --bound-tflops), the achieved
// weight-read rate of the hopper step, a device-to-device copy's rate (bytes
// read plus bytes written over time, 2 GiB) measured in the same process, and
// the largest |hopper - cublas| / max|cublas| and |hopper - wmma| / max|wmma|
// over the outputs, and the count of non-finite outputs (checks that the paths
// computed the same thing). CSV to stdout; progress to stderr.
//
// --paths fp8 (issue 35 item 4) times ExpertCompute::RunFp8 instead: the
// same seeded bf16 experts block-quantized to fp8 e4m3 on the device
// (LaunchQuantizeFp8BlockMatrices, DeepSeek-V3's 128 x 128 format), the
// whole step graph-replayed (grouping, gather + per-128 activation
// quantization, fused gate/up + SwiGLU + re-quantization, down, weighted
// sum), and each fp8 GEMM alone from its own graph on the step's own
// per-expert offsets (the step's tile height; with --fp8-tile-compare also
// 128 and 256 rows; 0 when not timed). Printed per token count
// (one CSV table): p50s, the step's and each GEMM's TFLOP/s (rows * 6 H I FLOP over the step, 4 H I
// and 2 H I per GEMM) and their share of --fp8-peak-tflops (1979), the
// fp8 weight-streaming bound (fp8 bytes + scales of the experts that got
// rows / --bound-tbps) and the step's ratio to it, the copy rate, and the
// largest |fp8 - bf16 hopper| / max|bf16| (the quantization's own error:
// a check that both computed the same experts) with non-finite counts.
// --fp8-cluster and --fp8-l2-hint (Fp8GemmParams::cluster, l2_hint) apply
// to the step and to each GEMM alone, so runs that differ only in them
// compare the variants (--fp8-tile-compare's extra rows keep the hint).
// Source: issue 14; issue 35; DESIGN §10.

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/expert_bench_util.h"
#include "core/bf16.h"
#include "kernels/device_experts.h"
#include "kernels/expert_compute.h"
#include "kernels/fp8_expert_kernels.cuh"
#include "kernels/fp8_grouped_gemm.cuh"

namespace moe_ep::kernels {
namespace {

// max |got - want| / max |want| over bf16 outputs; a non-finite element in
// either makes it infinite.
double MaxRel(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  double diff = 0, mag = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double w = core::Bf16ToFloat(want[i]);
    const double d = std::abs(core::Bf16ToFloat(got[i]) - w);
    if (!std::isfinite(d)) return INFINITY;
    diff = std::max(diff, d);
    mag = std::max(mag, std::abs(w));
  }
  return mag > 0 ? diff / mag : diff;
}

int64_t NonFinite(const std::vector<uint16_t>& v) {
  int64_t bad = 0;
  for (uint16_t x : v) bad += std::isfinite(core::Bf16ToFloat(x)) ? 0 : 1;
  return bad;
}

int Main(int argc, char** argv) {
  CLI::App app{"moe-ep SwiGLU expert compute: hopper vs wmma vs cuBLAS (issue 14)"};
  std::vector<int64_t> token_list = {1, 16, 128, 512, 4096};
  int num_experts = 128, top_k = 8, warmup = 5, iters = 30;
  int64_t hidden = 7168, inter = 2048;
  double bound_tbps = 4.8, bound_tflops = 790;
  std::vector<std::string> paths = {"hopper", "wmma", "cublas"};
  app.add_option("--tokens", token_list, "token counts");
  app.add_option("--experts", num_experts, "local experts (EP 1: all)");
  app.add_option("--topk", top_k);
  app.add_option("--hidden", hidden);
  app.add_option("--intermediate", inter);
  app.add_option("--warmup", warmup);
  app.add_option("--iters", iters);
  app.add_option("--paths", paths, "hopper, wmma, cublas; or fp8 alone (issue 35)");
  app.add_option("--bound-tbps", bound_tbps, "memory rate of the weight bound");
  app.add_option("--bound-tflops", bound_tflops, "bf16 matrix rate of the matrix bound");
  double fp8_peak_tflops = 1979;
  app.add_option("--fp8-peak-tflops", fp8_peak_tflops, "dense fp8 rate the fp8 path is a share of");
  int fp8_tile_rows = 0;
  app.add_option("--fp8-tile-rows", fp8_tile_rows, "the fp8 step's tile height: 0 auto, 128, 256");
  int fp8_prefetch = -1;
  app.add_option("--fp8-prefetch", fp8_prefetch,
                 "k-blocks of L2 prefetch ahead in the fp8 GEMMs (-1 the default)");
  int fp8_cluster = 0;
  app.add_option("--fp8-cluster", fp8_cluster,
                 "fp8 tiles in 2-CTA clusters: 0 auto, 1 off, 2 128-row tiles sharing A, 3 "
                 "pairs of m-tiles sharing B (either height)");
  int fp8_l2_hint = 0;
  app.add_option("--fp8-l2-hint", fp8_l2_hint,
                 "L2 policy of the fp8 TMA loads: 0 none, 1 A evict_last, 2 A evict_last + B "
                 "evict_first, 3 B evict_first");
  bool fp8_tile_compare = false;
  app.add_flag("--fp8-tile-compare", fp8_tile_compare,
               "also time each fp8 GEMM alone with 128- and 256-row tiles, one CTA a tile "
               "and in A-sharing 2-CTA clusters");
  CLI11_PARSE(app, argc, argv);
  const bool fp8_only = paths.size() == 1 && paths[0] == "fp8";

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Device-to-device copy rate (read + write), same process.
  const double copy_tbps = bench::CopyTbps(stream);
  std::fprintf(stderr, "d2d copy: %.2f TB/s (read + write)\n", copy_tbps);

  auto experts = DeviceExpertSet::GenerateSwiGlu(7, 3, 0, num_experts, hidden, inter);
  BENCH_CHECK(experts.status());
  const int64_t max_tokens = *std::max_element(token_list.begin(), token_list.end());
  auto ec = ExpertCompute::Create(max_tokens, top_k, hidden, inter, num_experts);
  BENCH_CHECK(ec.status());
  // fp8 experts: the bf16 ones block-quantized on the device.
  Fp8SwiGluExperts fp8;
  uint8_t* fp8_codes = nullptr;
  float* fp8_scales = nullptr;
  int32_t* fp8_slots = nullptr;
  const int64_t gsz = inter * hidden;
  const int64_t ssz = (inter / 128) * (hidden / 128);
  if (fp8_only) {
    CUDA_CHECK(cudaMalloc(&fp8_codes, num_experts * 3 * gsz));
    CUDA_CHECK(cudaMalloc(&fp8_scales, num_experts * 3 * ssz * 4));
    CUDA_CHECK(cudaMalloc(&fp8_slots, num_experts * 4));
    std::vector<int32_t> slots(num_experts);
    for (int e = 0; e < num_experts; ++e) slots[e] = e;
    CUDA_CHECK(cudaMemcpy(fp8_slots, slots.data(), num_experts * 4, cudaMemcpyHostToDevice));
    fp8.slot_ids = fp8_slots;
    fp8.num_experts = num_experts;
    fp8.hidden = hidden;
    fp8.intermediate = inter;
    fp8.gate_up = fp8_codes;
    fp8.down = fp8_codes + num_experts * 2 * gsz;
    fp8.gate_up_scale = fp8_scales;
    fp8.down_scale = fp8_scales + num_experts * 2 * ssz;
    BENCH_CHECK(LaunchQuantizeFp8BlockMatrices((*experts)->gate_up(), 2 * num_experts, inter,
                                               hidden, fp8_codes, fp8_scales, stream));
    BENCH_CHECK(LaunchQuantizeFp8BlockMatrices((*experts)->down(), num_experts, hidden, inter,
                                               fp8_codes + num_experts * 2 * gsz,
                                               fp8_scales + num_experts * 2 * ssz, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  (*ec)->SetFp8TileRowsForTest(fp8_tile_rows);
  (*ec)->SetFp8ClusterForTest(fp8_cluster);
  (*ec)->SetFp8L2PrefetchForTest(fp8_prefetch);
  (*ec)->SetFp8L2HintForTest(fp8_l2_hint);
  const int64_t row_bytes = 2 * hidden + 8 * top_k;
  uint8_t* recv = nullptr;
  uint16_t* out = nullptr;
  std::vector<uint16_t> ref_out;
  CUDA_CHECK(cudaMalloc(&recv, max_tokens * row_bytes));
  CUDA_CHECK(cudaMalloc(&out, max_tokens * hidden * 2));

  if (fp8_only) {
    std::printf(
        "tokens,rows,experts_hit,H,I,topk,fp8_step_graph_p50_us,fp8_gate_up_gemm_p50_us,"
        "fp8_down_gemm_p50_us,bf16_hopper_graph_p50_us,step_tflops,step_pct_fp8_peak,"
        "gemms_tflops,gemms_pct_fp8_peak,gate_up_tflops,down_tflops,fp8_weight_bound_us,"
        "step_vs_weight_bound,fp8_weight_tbps,copy_tbps,fp8_vs_bf16_max_rel,fp8_nonfinite,"
        "gate_up_128_rows_us,gate_up_256_rows_us,down_128_rows_us,down_256_rows_us,gate_up_128_"
        "cluster2_us,down_128_cluster2_us,gate_up_256_cluster2_us,down_256_cluster2_us\n");
  } else {
    std::printf(
        "tokens,rows,experts_hit,H,I,topk,hopper_kernel,hopper_graph_p50_us,wmma_graph_p50_us,"
        "cublas_eager_p50_us,weight_bound_us,matrix_bound_us,hopper_weight_tbps,copy_tbps,"
        "hopper_vs_cublas_max_rel,hopper_vs_wmma_max_rel,hopper_nonfinite,cublas_nonfinite\n");
  }
  for (const int64_t tokens : token_list) {
    std::mt19937_64 rng(1000 + tokens);
    std::set<int> hit;
    const std::vector<uint8_t> host =
        bench::MakeRecvRows(rng, tokens, hidden, top_k, num_experts, row_bytes, &hit);
    CUDA_CHECK(cudaMemcpy(recv, host.data(), host.size(), cudaMemcpyHostToDevice));
    const int64_t rows = tokens * top_k;
    auto run = [&] { BENCH_CHECK((*ec)->Run(recv, tokens, **experts, out, stream)); };
    auto graph_p50 = [&](ExpertGemm gemm) {
      BENCH_CHECK((*ec)->set_gemm(gemm));
      run();  // warm (module load, attributes) outside the capture
      CUDA_CHECK(cudaStreamSynchronize(stream));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      run();
      CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const double us =
          bench::TimeP50(stream, warmup, iters, [&] { CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      return us;
    };
    auto has = [&](const char* p) {
      return std::find(paths.begin(), paths.end(), p) != paths.end();
    };
    if (fp8_only) {
      // The bf16 Hopper step first (the comparison's output), then fp8.
      const double bf16_us = graph_p50(ExpertGemm::kGroupedDevice);
      std::vector<uint16_t> bf16_out(tokens * hidden), fp8_out(tokens * hidden);
      CUDA_CHECK(cudaMemcpy(bf16_out.data(), out, tokens * hidden * 2, cudaMemcpyDeviceToHost));
      auto run_fp8 = [&] { BENCH_CHECK((*ec)->RunFp8(recv, tokens, fp8, out, stream)); };
      run_fp8();
      CUDA_CHECK(cudaStreamSynchronize(stream));
      auto graph_of = [&](auto fn) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        fn();
        CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        const double us = bench::TimeP50(stream, warmup, iters,
                                         [&] { CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        return us;
      };
      const double step_us = graph_of(run_fp8);
      CUDA_CHECK(cudaMemcpy(fp8_out.data(), out, tokens * hidden * 2, cudaMemcpyDeviceToHost));
      // Each GEMM alone: operands of the step's sizes on the step's offsets
      // (the routing's per-expert counts, contiguous), activations seeded.
      std::vector<int32_t> counts(num_experts, 0);
      for (int64_t t = 0; t < tokens; ++t) {
        const auto* ids =
            reinterpret_cast<const int32_t*>(host.data() + t * row_bytes + 2 * hidden);
        for (int k = 0; k < top_k; ++k) ++counts[ids[k]];
      }
      std::vector<int32_t> offsets(num_experts + 1, 0);
      for (int e = 0; e < num_experts; ++e) offsets[e + 1] = offsets[e] + counts[e];
      int32_t* d_off = nullptr;
      uint8_t *a_codes = nullptr, *act_codes = nullptr;
      float *a_sc = nullptr, *act_sc = nullptr;
      uint16_t* y = nullptr;
      CUDA_CHECK(cudaMalloc(&d_off, (num_experts + 1) * 4));
      CUDA_CHECK(cudaMalloc(&a_codes, rows * hidden));
      CUDA_CHECK(cudaMalloc(&a_sc, rows * (hidden / 128) * 4));
      CUDA_CHECK(cudaMalloc(&act_codes, rows * inter));
      CUDA_CHECK(cudaMalloc(&act_sc, rows * (inter / 128) * 4));
      CUDA_CHECK(cudaMalloc(&y, rows * hidden * 2));
      CUDA_CHECK(cudaMemcpy(d_off, offsets.data(), (num_experts + 1) * 4, cudaMemcpyHostToDevice));
      // Any bf16 values will do: the gate/up weights' 2 E I rows of H, reused
      // in chunks (at one expert they are fewer than the rows); the block
      // scales land in a_sc and are overwritten below.
      const int64_t seed_rows = int64_t{2} * num_experts * inter;
      for (int64_t r0 = 0; r0 < rows; r0 += seed_rows) {
        BENCH_CHECK(LaunchQuantizeFp8BlockMatrices((*experts)->gate_up(), 1,
                                                   std::min(seed_rows, rows - r0), hidden,
                                                   a_codes + r0 * hidden, a_sc, stream));
      }
      const std::vector<float> a_sc_host(rows * (hidden / 128), 1.0f / 448);
      CUDA_CHECK(cudaMemcpy(a_sc, a_sc_host.data(), a_sc_host.size() * 4, cudaMemcpyHostToDevice));
      Fp8GemmParams gu;
      gu.a = a_codes;
      gu.a_scale = a_sc;
      gu.a_scale_stride = rows;
      gu.max_rows = rows;
      gu.b = fp8.gate_up;
      gu.b_scale = fp8.gate_up_scale;
      gu.offsets = d_off;
      gu.num_local_experts = num_experts;
      gu.n = inter;
      gu.k = hidden;
      gu.l2_prefetch = fp8_prefetch;
      gu.l2_hint = fp8_l2_hint;
      Fp8GemmParams dn = gu;
      dn.a = act_codes;
      dn.a_scale = act_sc;
      dn.b = fp8.down;
      dn.b_scale = fp8.down_scale;
      dn.n = hidden;
      dn.k = inter;
      // The gate/up graph runs first and leaves act codes and scales for down.
      // Each GEMM with the step's tile choice, then (--fp8-tile-compare) with
      // each height.
      // v: 0 the step's choice, 1 128 rows one CTA a tile, 2 256 rows, 3 128
      // rows in A-sharing 2-CTA clusters, 4 256 rows in them (issue 35).
      double gu_tile_us[5] = {0, 0, 0, 0, 0}, dn_tile_us[5] = {0, 0, 0, 0, 0};
      for (int v = 0; v < (fp8_tile_compare ? 5 : 1); ++v) {
        gu.tile_rows = dn.tile_rows = v == 0 ? fp8_tile_rows : (v == 2 || v == 4 ? 256 : 128);
        gu.cluster = dn.cluster = v == 0 ? fp8_cluster : (v >= 3 ? 2 : 1);
        gu_tile_us[v] = graph_of(
            [&] { BENCH_CHECK(LaunchFp8GroupedSwiGlu(gu, act_codes, act_sc, rows, stream)); });
        dn_tile_us[v] = graph_of([&] { BENCH_CHECK(LaunchFp8GroupedGemm(dn, y, stream)); });
      }
      const double gu_us = gu_tile_us[0];
      const double dn_us = dn_tile_us[0];
      cudaFree(d_off);
      cudaFree(a_codes);
      cudaFree(a_sc);
      cudaFree(act_codes);
      cudaFree(act_sc);
      cudaFree(y);
      const double flop = rows * 6.0 * hidden * inter;
      const double step_tflops = flop / (step_us * 1e-6) / 1e12;
      const double gemm_tflops = flop / ((gu_us + dn_us) * 1e-6) / 1e12;
      const double wbytes8 =
          static_cast<double>(hit.size()) * (3.0 * inter * hidden + 3.0 * ssz * 4);
      const double bound8_us = wbytes8 / (bound_tbps * 1e12) * 1e6;
      std::printf(
          "%lld,%lld,%zu,%lld,%lld,%d,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.3f,"
          "%.3f,%.3f,%.3e,%lld,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f,%.1f\n",
          static_cast<long long>(tokens), static_cast<long long>(rows), hit.size(),
          static_cast<long long>(hidden), static_cast<long long>(inter), top_k, step_us, gu_us,
          dn_us, bf16_us, step_tflops, 100 * step_tflops / fp8_peak_tflops, gemm_tflops,
          100 * gemm_tflops / fp8_peak_tflops, rows * 4.0 * hidden * inter / (gu_us * 1e-6) / 1e12,
          rows * 2.0 * hidden * inter / (dn_us * 1e-6) / 1e12, bound8_us, step_us / bound8_us,
          wbytes8 / (step_us * 1e-6) / 1e12, copy_tbps, MaxRel(fp8_out, bf16_out),
          static_cast<long long>(NonFinite(fp8_out)), gu_tile_us[1], gu_tile_us[2], dn_tile_us[1],
          dn_tile_us[2], gu_tile_us[3], dn_tile_us[3], gu_tile_us[4], dn_tile_us[4]);
      std::fflush(stdout);
      continue;
    }
    double hopper_us = 0, wmma_us = 0, cublas_us = 0, max_rel = -1;
    std::vector<uint16_t> hopper_out(tokens * hidden), cublas_out(tokens * hidden);
    if (has("cublas")) {
      BENCH_CHECK((*ec)->set_gemm(ExpertGemm::kCublasHostCounts));
      cublas_us = bench::TimeP50(stream, warmup, iters, run);
      CUDA_CHECK(cudaMemcpy(cublas_out.data(), out, tokens * hidden * 2, cudaMemcpyDeviceToHost));
    }
    if (has("hopper")) {
      hopper_us = graph_p50(ExpertGemm::kGroupedDevice);
      CUDA_CHECK(cudaMemcpy(hopper_out.data(), out, tokens * hidden * 2, cudaMemcpyDeviceToHost));
      if (has("cublas")) max_rel = MaxRel(hopper_out, cublas_out);
    }
    double max_rel_wmma = -1;
    if (has("wmma")) {
      wmma_us = graph_p50(ExpertGemm::kGroupedWmma);
      std::vector<uint16_t> wmma_out(tokens * hidden);
      CUDA_CHECK(cudaMemcpy(wmma_out.data(), out, tokens * hidden * 2, cudaMemcpyDeviceToHost));
      if (has("hopper")) max_rel_wmma = MaxRel(hopper_out, wmma_out);
    }
    const int64_t bad_hopper = has("hopper") ? NonFinite(hopper_out) : -1;
    const int64_t bad_cublas = has("cublas") ? NonFinite(cublas_out) : -1;
    const double wbytes = static_cast<double>(hit.size()) * 3 * inter * hidden * 2;
    const double weight_bound_us = wbytes / (bound_tbps * 1e12) * 1e6;
    const double matrix_bound_us = rows * 6.0 * hidden * inter / (bound_tflops * 1e12) * 1e6;
    const double hopper_tbps = hopper_us > 0 ? wbytes / (hopper_us * 1e-6) / 1e12 : 0;
    std::printf(
        "%lld,%lld,%zu,%lld,%lld,%d,%d,%.1f,%.1f,%.1f,%.1f,%.1f,%.3f,%.3f,%.2e,%.2e,%lld,%lld\n",
        static_cast<long long>(tokens), static_cast<long long>(rows), hit.size(),
        static_cast<long long>(hidden), static_cast<long long>(inter), top_k,
        (*ec)->UsesHopperGemm(inter) ? 1 : 0, hopper_us, wmma_us, cublas_us, weight_bound_us,
        matrix_bound_us, hopper_tbps, copy_tbps, max_rel, max_rel_wmma,
        static_cast<long long>(bad_hopper), static_cast<long long>(bad_cublas));
    std::fflush(stdout);
  }
  cudaFree(recv);
  cudaFree(out);
  cudaFree(fp8_codes);
  cudaFree(fp8_scales);
  cudaFree(fp8_slots);
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace
}  // namespace moe_ep::kernels

int main(int argc, char** argv) {
  try {
    return moe_ep::kernels::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "expert_bench: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "expert_bench: error: an exception that is not a std::exception\n");
  }
  return 1;
}
