// The C API's engine data calls (server/moe_ep.h; issue 16 item 1, issue 34
// item 2) through libmoe_ep.so only, on any data plane: embedded workers
// (one a process), the group formed by `moe-ep up --targets` (argv[1]), then
// on the plane's buffers (device memory and a caller stream on the GPU
// planes, host memory on gloo): the token-count agreement; dispatch into
// recv_rows > R (padding slots), the caller's experts (expert e scales by
// (e + 1) / 8) and combine against a host reference; forward with the
// worker's identity experts; on the GPU planes dispatch + combine captured
// in a CUDA graph and replayed with new inputs, the graph token
// (MOE_EP_RECAPTURE for another one) and host pointers refused naming the
// argument; with peers, a refusal on the last rank only ends the peers' step
// at once (the GPU planes: their moe_ep_check_step names it; gloo: their
// call returns ABORTED naming it; issue 30 item 1); an expert id out of
// range on the last rank named by that rank (DESIGN §7) and the next step
// exact. Usage: engine_embedded MOE_EP_CLI [nccl|one-sided|gloo] [world 1-4].
// nccl (the default) runs rank r on CUDA device r (NCCL takes one rank a
// device); one-sided runs every rank on device 0 (CUDA IPC windows); gloo
// needs no GPU. Each rank checks what it received from every source and its
// combined output against the host reference of its own tokens; rank 2 has
// no tokens. Exits 77 (skipped, with the reason) without the CUDA devices
// it needs. The capability matrix runs it on each column
// (tests/integration/capability_matrix_test.cc).

#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "server/moe_ep.h"

namespace {

constexpr int kHidden = 128;
constexpr int kExperts = 8;
constexpr int kTopK = 2;
constexpr int kCapacity = 64;
constexpr int kR = 32;     // committed R
constexpr int kRows = 40;  // recv_rows of the eager dispatch (> R)

int failures = 0;
bool host_plane = false;  // gloo: host buffers, a null stream, no CUDA call
bool one_sided = false;   // the one-sided plane, its windows with receive buffers

#define EXPECT(cond, ...)                               \
  do {                                                  \
    if (!(cond)) {                                      \
      std::fprintf(stderr, "FAIL line %d: ", __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                \
      std::fprintf(stderr, "\n");                       \
      ++failures;                                       \
    }                                                   \
  } while (0)

#define CUDA(call)                                                           \
  do {                                                                       \
    cudaError_t e_ = (call);                                                 \
    if (e_ != cudaSuccess) {                                                 \
      std::fprintf(stderr, "FATAL %s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

bool Ok(moe_ep_status s, const char* what) {
  if (s == MOE_EP_OK) return true;
  std::fprintf(stderr, "FAIL %s: status %d: %s\n", what, s, moe_ep_last_error());
  ++failures;
  return false;
}

uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// True when the `n` floats at `a` and `b` have the same bit patterns (the
// dispatch copies weights, so bit-exact; unlike ==, -0 and NaN payloads count).
bool SameBits(const float* a, const float* b, int n) {
  for (int i = 0; i < n; ++i) {
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return false;
  }
  return true;
}

float FromBf16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Inputs {
  std::vector<uint16_t> hidden;  // [T, H]
  std::vector<int32_t> ids;      // [T, K]
  std::vector<float> weights;    // [T, K]
};

Inputs MakeInputs(int tokens, int seed, int32_t invalid) {
  Inputs in;
  uint32_t state = 2654435761u * static_cast<uint32_t>(seed + 1);
  auto next = [&state] {
    state = state * 1664525u + 1013904223u;
    return state >> 8;
  };
  for (int i = 0; i < tokens * kHidden; ++i) {
    in.hidden.push_back(ToBf16(static_cast<float>(next() % 2001) / 1000.0f - 1.0f));
  }
  for (int t = 0; t < tokens; ++t) {
    const int a = static_cast<int>(next() % kExperts);
    const int b = (a + 1 + static_cast<int>(next() % (kExperts - 1))) % kExperts;
    in.ids.push_back(t % 7 == 3 ? invalid : a);  // some choices select no expert
    in.ids.push_back(t % 11 == 5 ? invalid : b);
    if (t % 13 == 6) in.ids[in.ids.size() - 2] = in.ids[in.ids.size() - 1] = invalid;
    in.weights.push_back(static_cast<float>(next() % 1000) / 1000.0f);
    in.weights.push_back(static_cast<float>(next() % 1000) / 1000.0f);
  }
  return in;
}

// The caller's experts: expert e multiplies by (e + 1) / 8.
float Scale(int32_t id) { return static_cast<float>(id + 1) / 8.0f; }

// sum_k w_k * scale(k) * x over valid choices; scale = nullptr: identity.
std::vector<float> Reference(const Inputs& in, int tokens, int32_t invalid, bool scaled) {
  std::vector<float> out(static_cast<size_t>(tokens) * kHidden, 0.0f);
  for (int t = 0; t < tokens; ++t) {
    for (int k = 0; k < kTopK; ++k) {
      const int32_t id = in.ids[t * kTopK + k];
      if (id == invalid) continue;
      const float c = in.weights[t * kTopK + k] * (scaled ? Scale(id) : 1.0f);
      for (int h = 0; h < kHidden; ++h)
        out[t * kHidden + h] += c * FromBf16(in.hidden[t * kHidden + h]);
    }
  }
  return out;
}

void ExpectClose(const char* what, const std::vector<uint16_t>& got,
                 const std::vector<float>& want) {
  float worst = 0.0f;
  size_t at = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    // Each rank's partial (|p| <= 2) is rounded to bf16 (2^-9 relative)
    // before the sum: 2 ranks * 2 * 2^-9 < 8e-3 absolute, then the output's
    // own rounding.
    const float err = std::fabs(FromBf16(got[i]) - want[i]) - 1e-2f * std::fabs(want[i]) - 8e-3f;
    if (err > worst) {
      worst = err;
      at = i;
    }
  }
  EXPECT(worst <= 0.0f, "%s: element %zu got %g want %g", what, at, FromBf16(got[at]), want[at]);
}

// A zeroed buffer of the plane's memory (device, or host on gloo).
template <typename T>
T* Device(size_t count) {
  if (host_plane) return static_cast<T*>(std::calloc(count * sizeof(T) + 16, 1));
  void* p = nullptr;
  CUDA(cudaMalloc(&p, count * sizeof(T) + 16));
  CUDA(cudaMemset(p, 0, count * sizeof(T) + 16));
  // cudaMemset may still run on the legacy stream, which a non-blocking
  // stream's uploads do not wait for: finish it before any upload.
  CUDA(cudaDeviceSynchronize());
  return static_cast<T*>(p);
}

template <typename T>
void Upload(T* dst, const std::vector<T>& src, cudaStream_t s) {
  if (host_plane) {
    if (!src.empty()) std::memcpy(dst, src.data(), src.size() * sizeof(T));
    return;
  }
  CUDA(cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice, s));
}

template <typename T>
std::vector<T> Download(const T* src, size_t count) {
  std::vector<T> out(count);
  if (host_plane) {
    if (count > 0) std::memcpy(out.data(), src, count * sizeof(T));
    return out;
  }
  CUDA(cudaMemcpy(out.data(), src, count * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

void Sync(cudaStream_t s) {
  if (!host_plane) CUDA(cudaStreamSynchronize(s));
}

void Fill(void* dst, int byte, size_t bytes, cudaStream_t s) {
  if (host_plane) {
    std::memset(dst, byte, bytes);
  } else {
    CUDA(cudaMemsetAsync(dst, byte, bytes, s));
  }
}

void Free(void* p) {
  if (host_plane) {
    std::free(p);
  } else {
    CUDA(cudaFree(p));
  }
}

// Tokens of rank `rank` of `world` in the eager steps: uneven, and rank 2
// of 4 has none (the last rank, which refuses in steps 4b and 5, has some).
int TokensOf(int rank, int world) {
  constexpr int kTokens[] = {20, 13, 0, 7};
  return world == 3 && rank == 2 ? 5 : kTokens[rank];
}

// The checks of one rank on CUDA `device`; `world` ranks with the inputs
// MakeInputs(TokensOf(s, world), 1 + 100 * s).
void RunRank(moe_ep_worker* worker, int world, int device) {
  moe_ep_worker_info info;
  info.struct_size = sizeof(info);
  Ok(moe_ep_worker_info_get(worker, &info), "moe_ep_worker_info_get");
  const int32_t backend = host_plane ? MOE_EP_BACKEND_GLOO : MOE_EP_BACKEND_NCCL;
  EXPECT(
      info.backend == backend && (host_plane || info.device == device) && info.world_size == world,
      "info: backend %d (want %d) device %d (want %d) world %d", info.backend, backend, info.device,
      device, info.world_size);
  const int rank = info.rank;
  const int32_t invalid = info.invalid_expert_id;
  const int first = info.first_expert;
  const int local = info.num_local_experts;
  const int rows = world * kRows;  // [E, kRows] receive slots

  cudaStream_t stream = nullptr;
  if (!host_plane) {
    CUDA(cudaSetDevice(device));
    CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  auto* d_hidden = Device<uint16_t>(kCapacity * kHidden);
  auto* d_ids = Device<int32_t>(kCapacity * kTopK);
  auto* d_weights = Device<float>(kCapacity * kTopK);
  auto* d_recv_hidden = Device<uint16_t>(rows * kHidden);
  auto* d_recv_ids = Device<int32_t>(rows * kTopK);
  auto* d_recv_weights = Device<float>(rows * kTopK);
  auto* d_source_counts = Device<int64_t>(world);
  auto* d_expert_counts = Device<int64_t>(kExperts);
  auto* d_expert_out = Device<uint16_t>(rows * kHidden);
  auto* d_output = Device<uint16_t>(kCapacity * kHidden);
  auto* d_local_tokens = Device<int64_t>(1);
  auto* d_token_counts = Device<int64_t>(world);

  // 0. The token counts agreed (on the device buffers on the GPU planes).
  const int tokens = TokensOf(rank, world);
  Upload(d_local_tokens, std::vector<int64_t>{tokens}, stream);
  if (host_plane) {
    int64_t r_max = 0;
    Ok(moe_ep_sync_token_counts(worker, tokens, d_token_counts, &r_max),
       "moe_ep_sync_token_counts");
    EXPECT(r_max >= TokensOf(0, world), "runtime_max_tokens_per_rank %lld < rank 0's %d tokens",
           static_cast<long long>(r_max), TokensOf(0, world));
  } else {
    Ok(moe_ep_sync_token_counts_async(worker, d_local_tokens, d_token_counts, stream, 0),
       "moe_ep_sync_token_counts_async");
  }
  Sync(stream);
  const auto counts = Download(d_token_counts, world);
  for (int s = 0; s < world; ++s) {
    EXPECT(counts[s] == TokensOf(s, world), "token count of rank %d: %lld, want %d", s,
           static_cast<long long>(counts[s]), TokensOf(s, world));
  }

  // 1. Eager dispatch (recv_rows 40 > R 32), the caller's experts, combine.
  std::vector<Inputs> all;
  all.reserve(world);
  for (int s = 0; s < world; ++s)
    all.push_back(MakeInputs(TokensOf(s, world), 1 + 100 * s, invalid));
  const Inputs& in = all[rank];
  Upload(d_hidden, in.hidden, stream);
  Upload(d_ids, in.ids, stream);
  Upload(d_weights, in.weights, stream);
  // Counts that hold another step's values: the dispatch starts them from zero.
  Upload(d_source_counts, std::vector<int64_t>(world, 777), stream);
  Upload(d_expert_counts, std::vector<int64_t>(kExperts, 777), stream);
  // Receive buffers that hold another step's rows: every padding slot is
  // written, not left as it was.
  Fill(d_recv_hidden, 0x5a, rows * kHidden * sizeof(uint16_t), stream);
  Fill(d_recv_ids, 0x5a, rows * kTopK * sizeof(int32_t), stream);
  Fill(d_recv_weights, 0x5a, rows * kTopK * sizeof(float), stream);
  Ok(moe_ep_commit_geometry(worker, 1, kR, tokens), "commit_geometry");
  Ok(moe_ep_dispatch(worker, d_hidden, d_ids, d_weights, tokens, d_recv_hidden, d_recv_ids,
                     d_recv_weights, kRows, d_source_counts, d_expert_counts, stream, 0),
     "moe_ep_dispatch");
  Sync(stream);
  auto is_local = [&](int32_t id) { return id != invalid && id >= first && id < first + local; };
  // A dispatch's received rows (kRows slots per source; the padding slots
  // below pad_until) and counts against `all`, then the caller's experts on
  // them (each slot's weighted sum over its local choices) and the combine,
  // against the reference.
  auto check_step = [&](const char* what, const std::vector<uint16_t>& recv_hidden,
                        const std::vector<int32_t>& recv_ids,
                        const std::vector<float>& recv_weights,
                        const std::vector<int64_t>& source_counts,
                        const std::vector<int64_t>& expert_counts, int pad_until) {
    std::vector<int64_t> want_experts(local, 0);
    for (int s = 0; s < world; ++s) {
      const Inputs& src = all[s];
      int slot = 0;
      for (int t = 0; t < TokensOf(s, world); ++t) {
        bool here = false;
        for (int k = 0; k < kTopK; ++k) {
          const int32_t id = src.ids[t * kTopK + k];
          if (is_local(id)) {
            ++want_experts[id - first];
            here = true;
          }
        }
        if (!here) continue;
        const int j = s * kRows + slot;
        EXPECT(std::memcmp(&recv_hidden[j * kHidden], &src.hidden[t * kHidden], kHidden * 2) == 0,
               "%s: source %d slot %d: hidden is not token %d's", what, s, slot, t);
        EXPECT(std::memcmp(&recv_ids[j * kTopK], &src.ids[t * kTopK], kTopK * 4) == 0 &&
                   SameBits(&recv_weights[j * kTopK], &src.weights[t * kTopK], kTopK),
               "%s: source %d slot %d: ids / weights are not token %d's", what, s, slot, t);
        ++slot;
      }
      EXPECT(source_counts[s] == slot, "%s: source_counts[%d] %lld, want %d", what, s,
             static_cast<long long>(source_counts[s]), slot);
      for (int j = slot; j < pad_until; ++j) {
        const int at = s * kRows + j;
        for (int k = 0; k < kTopK; ++k) {
          EXPECT(recv_ids[at * kTopK + k] == invalid && recv_weights[at * kTopK + k] == 0.0f,
                 "%s: source %d padding slot %d choice %d: id %d weight %g", what, s, j, k,
                 recv_ids[at * kTopK + k], recv_weights[at * kTopK + k]);
        }
        EXPECT(std::all_of(&recv_hidden[at * kHidden], &recv_hidden[(at + 1) * kHidden],
                           [](uint16_t v) { return v == 0; }),
               "%s: source %d padding slot %d: hidden not zero", what, s, j);
      }
    }
    for (int l = 0; l < local; ++l) {
      EXPECT(expert_counts[l] == want_experts[l], "%s: expert_counts[%d] %lld, want %lld", what, l,
             static_cast<long long>(expert_counts[l]), static_cast<long long>(want_experts[l]));
    }
    std::vector<uint16_t> expert_out(rows * kHidden, 0);
    for (int j = 0; j < rows; ++j) {
      for (int h = 0; h < kHidden; ++h) {
        float acc = 0.0f;
        for (int k = 0; k < kTopK; ++k) {
          const int32_t id = recv_ids[j * kTopK + k];
          if (is_local(id))
            acc += recv_weights[j * kTopK + k] * Scale(id) * FromBf16(recv_hidden[j * kHidden + h]);
        }
        expert_out[j * kHidden + h] = ToBf16(acc);
      }
    }
    Upload(d_expert_out, expert_out, stream);
    Ok(moe_ep_combine(worker, d_expert_out, kRows, d_output, stream, 0), "moe_ep_combine");
    Sync(stream);
    ExpectClose(what, Download(d_output, tokens * kHidden), Reference(in, tokens, invalid, true));
  };
  check_step("combine", Download(d_recv_hidden, rows * kHidden), Download(d_recv_ids, rows * kTopK),
             Download(d_recv_weights, rows * kTopK), Download(d_source_counts, world),
             Download(d_expert_counts, local), kRows);

  // 2. Forward with the worker's identity experts.
  Ok(moe_ep_commit_geometry(worker, 2, kR, tokens), "commit_geometry");
  Ok(moe_ep_forward(worker, 0, d_hidden, d_ids, d_weights, tokens, d_output, stream, 0),
     "moe_ep_forward");
  Sync(stream);
  ExpectClose("forward", Download(d_output, tokens * kHidden),
              Reference(in, tokens, invalid, false));
  Ok(moe_ep_check_step(worker, 0), "moe_ep_check_step");

  // 3. GPU planes: dispatch + combine (the received rows as expert outputs,
  // rows = R) captured in a CUDA graph, replayed twice with new inputs.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (!host_plane) {
    Ok(moe_ep_commit_geometry(worker, 3, kR, 0), "commit_geometry(bucket)");
    uint64_t token = 0;
    Ok(moe_ep_graph_token(worker, &token), "moe_ep_graph_token");
    CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const moe_ep_status captured_dispatch =
        moe_ep_dispatch(worker, d_hidden, d_ids, d_weights, kR, d_recv_hidden, d_recv_ids,
                        d_recv_weights, kR, d_source_counts, d_expert_counts, stream, 0);
    const moe_ep_status captured_combine =
        moe_ep_combine(worker, d_recv_hidden, kR, d_output, stream, 0);
    CUDA(cudaStreamEndCapture(stream, &graph));
    Ok(captured_dispatch, "captured moe_ep_dispatch");
    Ok(captured_combine, "captured moe_ep_combine");
    CUDA(cudaGraphInstantiate(&exec, graph, 0));
    const int experts_per_rank = kExperts / world;
    for (int replay = 0; replay < 2; ++replay) {
      Inputs next = MakeInputs(kR, 10 + replay + 100 * rank, invalid);
      Upload(d_hidden, next.hidden, stream);
      Upload(d_ids, next.ids, stream);
      Upload(d_weights, next.weights, stream);
      EXPECT(moe_ep_check_graph(worker, token) == MOE_EP_OK, "check_graph: %s",
             moe_ep_last_error());
      CUDA(cudaGraphLaunch(exec, stream));
      Sync(stream);
      // The received rows go back as they are: a routed token returns x once
      // for every rank that holds one of its experts.
      std::vector<float> want(kR * kHidden, 0.0f);
      for (int t = 0; t < kR; ++t) {
        int ranks = 0;
        for (int d = 0; d < world; ++d) {
          bool to_d = false;
          for (int k = 0; k < kTopK; ++k) {
            const int32_t id = next.ids[t * kTopK + k];
            to_d = to_d || (id != invalid && id / experts_per_rank == d);
          }
          ranks += to_d ? 1 : 0;
        }
        for (int h = 0; h < kHidden; ++h)
          want[t * kHidden + h] =
              static_cast<float>(ranks) * FromBf16(next.hidden[t * kHidden + h]);
      }
      ExpectClose(replay == 0 ? "graph replay 0" : "graph replay 1",
                  Download(d_output, kR * kHidden), want);
    }
    Ok(moe_ep_check_step(worker, 0), "moe_ep_check_step after replays");
    EXPECT(moe_ep_check_graph(worker, token + 1000) == MOE_EP_RECAPTURE,
           "check_graph of another workspace's token: expected MOE_EP_RECAPTURE");

    // 4. Host pointers are refused, naming the argument (every rank refuses
    // here, so the refusals it enqueues meet each other and report nothing).
    // At least one token a rank: with none, hidden is never read, so a rank
    // of no tokens may pass any pointer (and would dispatch beside the
    // refusals: the one-sided run of 4 ranks, rank 2, at first).
    const int64_t host_tokens = std::max(tokens, 1);
    const std::vector<uint16_t> host_hidden(host_tokens * kHidden, 0);
    Ok(moe_ep_commit_geometry(worker, 4, kR, host_tokens), "commit_geometry");
    const moe_ep_status host = moe_ep_dispatch(
        worker, host_hidden.data(), d_ids, d_weights, host_tokens, d_recv_hidden, d_recv_ids,
        d_recv_weights, kR, d_source_counts, d_expert_counts, stream, 0);
    EXPECT(host == MOE_EP_INVALID_ARGUMENT && std::strstr(moe_ep_last_error(), "hidden"),
           "host hidden: status %d (%s)", host, moe_ep_last_error());
  }  // the GPU planes' steps 3 and 4

  // 4b. With peers: only the last rank's arguments fail while its peers
  // dispatch (then forward), once with a host (gloo: null) hidden and once
  // with T = R + 1.
  // On the GPU planes the refusing rank enqueues a refusal in place of its
  // step (issue 30 item 1; the one-sided plane in its flags, the nccl plane
  // in the step header of the same transfers), so the peers' dispatch and
  // combine end at once with no output and their check_step names it; on
  // gloo the call's agreement round returns ABORTED naming it on the peers.
  // The group stays usable (the next refusal and step 5 run on).
  struct Refusal {
    const char* what;
    const char* names;  // the argument the refusing rank's error names
    bool host_hidden;
    int64_t tokens;
    bool forward;  // every rank calls moe_ep_forward (else dispatch + combine)
  };
  const Refusal refusals[] = {
      {host_plane ? "null hidden" : "host hidden", "hidden", true, tokens, false},
      {"T = R + 1", "num_tokens", false, kR + 1, false},
      {"forward, T = R + 1", "num_tokens", false, kR + 1, true},
      {host_plane ? "forward, null hidden" : "forward, host hidden", "hidden", true, tokens, true}};
  for (int k = 0; world > 1 && k < 4; ++k) {
    const Refusal& f = refusals[k];
    Fill(d_output, 0xff, tokens * kHidden * sizeof(uint16_t), stream);
    Ok(moe_ep_commit_geometry(worker, 40 + k, kR, tokens), "commit_geometry");
    const bool refusing = rank == world - 1;
    const uint16_t* hidden_arg = !refusing || !f.host_hidden ? d_hidden
                                 : host_plane                ? nullptr
                                                             : in.hidden.data();
    const int64_t tokens_arg = refusing ? f.tokens : tokens;
    const moe_ep_status dispatched =
        f.forward ? moe_ep_forward(worker, 0, hidden_arg, d_ids, d_weights, tokens_arg, d_output,
                                   stream, 0)
                  : moe_ep_dispatch(worker, hidden_arg, d_ids, d_weights, tokens_arg, d_recv_hidden,
                                    d_recv_ids, d_recv_weights, kRows, d_source_counts,
                                    d_expert_counts, stream, 0);
    if (refusing) {
      EXPECT(dispatched == MOE_EP_INVALID_ARGUMENT && std::strstr(moe_ep_last_error(), f.names),
             "refusing rank's %s: status %d (%s)", f.what, dispatched, moe_ep_last_error());
    }
    char want[80];
    std::snprintf(want, sizeof(want), "rank %d refused its", world - 1);
    if (!refusing && host_plane) {
      EXPECT(dispatched == MOE_EP_ABORTED && std::strstr(moe_ep_last_error(), want),
             "dispatch beside a refusing rank (%s): status %d (%s), want ABORTED with '%s'", f.what,
             dispatched, moe_ep_last_error(), want);
    } else if (!refusing) {
      Ok(dispatched, f.forward ? "moe_ep_forward beside a refusing rank"
                               : "moe_ep_dispatch beside a refusing rank");
      if (!f.forward) {
        Ok(moe_ep_combine(worker, d_expert_out, kRows, d_output, stream, 0),
           "moe_ep_combine beside a refusing rank");
      }
    }
    Sync(stream);
    const moe_ep_status refused = moe_ep_check_step(worker, 0);
    if (refusing || host_plane) {
      EXPECT(refused == MOE_EP_OK, "check_step of rank %d (%s): status %d (%s)", rank, f.what,
             refused, moe_ep_last_error());
    }
    if (!refusing) {
      EXPECT(host_plane || (refused == MOE_EP_ABORTED && std::strstr(moe_ep_last_error(), want)),
             "check_step beside a refusing rank (%s): status %d (%s), want ABORTED with '%s'",
             f.what, refused, moe_ep_last_error(), want);
      for (uint16_t v : Download(d_output, tokens * kHidden)) {
        if (v != 0xffff) {
          EXPECT(false, "rank %d wrote an output row of the refused step (%s)", rank, f.what);
          break;
        }
      }
    }
  }

  // 4c. Every rank dispatched, then only the last rank's combine fails its
  // checks (recv_rows < R). Gloo: the combine's round returns ABORTED naming
  // it on the peers and the step stays dispatched everywhere, so a second
  // combine on every rank completes it (checked against step 1's reference:
  // same inputs, same expert outputs). One-sided and nccl: the refusing rank
  // runs a refused combine in place of its own (issue 30 item 1: flags
  // marked refused; a header among the combine's NCCL transfers), so the
  // peers' combine ends at once without output, their check_step names it,
  // and the step is over. At world 1 the one rank is the refusing one.
  {
    Upload(d_hidden, in.hidden, stream);  // the graph replays left other inputs there
    Upload(d_ids, in.ids, stream);
    Upload(d_weights, in.weights, stream);
    Fill(d_output, 0xff, tokens * kHidden * sizeof(uint16_t), stream);
    Ok(moe_ep_commit_geometry(worker, 45, kR, tokens), "commit_geometry");
    Ok(moe_ep_dispatch(worker, d_hidden, d_ids, d_weights, tokens, d_recv_hidden, d_recv_ids,
                       d_recv_weights, kRows, d_source_counts, d_expert_counts, stream, 0),
       "moe_ep_dispatch before a refused combine");
    const bool refusing = rank == world - 1;
    char want[80];
    std::snprintf(want, sizeof(want), "rank %d refused its", world - 1);
    const moe_ep_status combined =
        moe_ep_combine(worker, d_expert_out, refusing ? kR - 1 : kRows, d_output, stream, 0);
    if (refusing) {
      EXPECT(combined == MOE_EP_INVALID_ARGUMENT &&
                 std::strstr(moe_ep_last_error(), "rows per source"),
             "refusing rank's combine (recv_rows < R): status %d (%s)", combined,
             moe_ep_last_error());
    } else if (host_plane) {
      EXPECT(combined == MOE_EP_ABORTED && std::strstr(moe_ep_last_error(), want),
             "combine beside a refusing rank: status %d (%s), want ABORTED with '%s'", combined,
             moe_ep_last_error(), want);
    } else {
      Ok(combined, "moe_ep_combine beside a refused combine");
    }
    Sync(stream);
    const moe_ep_status checked = moe_ep_check_step(worker, 0);
    if (refusing || host_plane) {
      EXPECT(checked == MOE_EP_OK, "check_step of rank %d after a refused combine: %d (%s)", rank,
             checked, moe_ep_last_error());
    } else {
      std::snprintf(want, sizeof(want), "rank %d refused its combine", world - 1);
      EXPECT(checked == MOE_EP_ABORTED && std::strstr(moe_ep_last_error(), want),
             "check_step beside a refused combine: status %d (%s), want ABORTED with '%s'", checked,
             moe_ep_last_error(), want);
    }
    for (uint16_t v : Download(d_output, tokens * kHidden)) {
      if (v != 0xffff) {
        EXPECT(false, "rank %d wrote an output row of a refused combine", rank);
        break;
      }
    }
    if (host_plane) {
      Ok(moe_ep_combine(worker, d_expert_out, kRows, d_output, stream, 0),
         "moe_ep_combine again after a refused combine");
      ExpectClose("combine again after a refused combine", Download(d_output, tokens * kHidden),
                  Reference(in, tokens, invalid, true));
    } else {
      const moe_ep_status again = moe_ep_combine(worker, d_expert_out, kRows, d_output, stream, 0);
      EXPECT(again == MOE_EP_FAILED_PRECONDITION,
             "a second combine of a refused combine's step: status %d (%s), want "
             "FAILED_PRECONDITION (the step is over)",
             again, moe_ep_last_error());
    }
  }

  // 5. An expert id out of range on the last rank (DESIGN §7; issue 30). GPU
  // planes: the ids are on the device, so the route kernel records it, that
  // choice selects no expert, and the step's sync point names it on that
  // rank only. Gloo: the dispatcher's agreement round fails the step before
  // anything moves, INVALID_ARGUMENT naming it there, ABORTED on the peers.
  Inputs bad = in;
  const int bad_row = tokens - 1;
  const int32_t bad_id = kExperts + 5;
  if (rank == world - 1) bad.ids[bad_row * kTopK + 1] = bad_id;
  Upload(d_hidden, in.hidden, stream);  // the graph replays left other inputs there
  Upload(d_ids, bad.ids, stream);
  Upload(d_weights, in.weights, stream);
  Ok(moe_ep_commit_geometry(worker, 5, kR, tokens), "commit_geometry");
  const moe_ep_status forwarded =
      moe_ep_forward(worker, 0, d_hidden, d_ids, d_weights, tokens, d_output, stream, 0);
  if (host_plane) {
    char want[96];
    if (rank == world - 1) {
      std::snprintf(want, sizeof(want), "topk_ids[row %d, choice 1] = %d", bad_row, bad_id);
    } else {
      std::snprintf(want, sizeof(want), "rank %d", world - 1);
    }
    const moe_ep_status code = rank == world - 1 ? MOE_EP_INVALID_ARGUMENT : MOE_EP_ABORTED;
    EXPECT(forwarded == code && std::strstr(moe_ep_last_error(), want),
           "forward with an id out of range on rank %d: status %d (%s), want %d with '%s'",
           world - 1, forwarded, moe_ep_last_error(), code, want);
  } else {
    Ok(forwarded, "moe_ep_forward (an id out of range)");
  }
  Sync(stream);
  const moe_ep_status checked = moe_ep_check_step(worker, 0);
  if (host_plane) {
    EXPECT(checked == MOE_EP_OK, "check_step after a refused forward: status %d (%s)", checked,
           moe_ep_last_error());
  } else if (rank == world - 1) {
    char want[96];
    std::snprintf(want, sizeof(want), "topk_ids[row %d, choice 1] = %d", bad_row, bad_id);
    EXPECT(checked == MOE_EP_INVALID_ARGUMENT && std::strstr(moe_ep_last_error(), want),
           "check_step after an id out of range: status %d (%s), want INVALID_ARGUMENT with '%s'",
           checked, moe_ep_last_error(), want);
    Inputs masked = in;
    masked.ids[bad_row * kTopK + 1] = invalid;
    ExpectClose("forward with the bad choice masked", Download(d_output, tokens * kHidden),
                Reference(masked, tokens, invalid, false));
  } else {
    EXPECT(checked == MOE_EP_OK, "check_step of a peer of the bad id: status %d (%s)", checked,
           moe_ep_last_error());
  }
  // Step 6's receive buffers get stale bytes here, before this rank's next
  // step: a peer may store its step-6 rows into them once this rank's
  // combine of that step has run (stream order keeps the fill first), and
  // not before.
  uint16_t* rb_hidden = nullptr;
  int32_t* rb_ids = nullptr;
  float* rb_weights = nullptr;
  int64_t rb_rows = 0;
  const moe_ep_status rb =
      moe_ep_receive_buffers(worker, &rb_hidden, &rb_ids, &rb_weights, &rb_rows);
  const std::string rb_error = moe_ep_last_error();
  if (one_sided && rb == MOE_EP_OK) {
    const int64_t n = world * rb_rows;
    Fill(rb_hidden, 0x5a, n * kHidden * sizeof(uint16_t), stream);
    Fill(rb_ids, 0x5a, n * kTopK * sizeof(int32_t), stream);
    Fill(rb_weights, 0x5a, n * kTopK * sizeof(float), stream);
  }
  // The record was reset and nothing broke: the next step is exact everywhere.
  Upload(d_ids, in.ids, stream);
  Ok(moe_ep_commit_geometry(worker, 6, kR, tokens), "commit_geometry");
  Ok(moe_ep_forward(worker, 0, d_hidden, d_ids, d_weights, tokens, d_output, stream, 0),
     "moe_ep_forward after the refused ids");
  Sync(stream);
  ExpectClose("forward after the refused ids", Download(d_output, tokens * kHidden),
              Reference(in, tokens, invalid, false));
  Ok(moe_ep_check_step(worker, 0), "moe_ep_check_step after the refused ids");

  // 6. The window's receive buffers (one-sided, workers started with
  // --onesided-receive-buffers; issue 30): [E, N] slots, the peers store
  // their rows in place; step 1's values in the slots below R (slots [R, N)
  // are not written). Gloo and nccl: MOE_EP_UNIMPLEMENTED.
  if (!one_sided) {
    EXPECT(rb == MOE_EP_UNIMPLEMENTED && rb_error.find("receive buffers") != std::string::npos,
           "moe_ep_receive_buffers off the one-sided plane: status %d (%s), want UNIMPLEMENTED", rb,
           rb_error.c_str());
  } else if (rb != MOE_EP_OK) {
    EXPECT(false, "moe_ep_receive_buffers: status %d (%s)", rb, rb_error.c_str());
  } else {
    EXPECT(rb_rows == kCapacity, "receive buffers: %lld rows per source, want N = %d",
           static_cast<long long>(rb_rows), kCapacity);
    const int64_t n = world * rb_rows;
    Upload(d_source_counts, std::vector<int64_t>(world, 777), stream);
    Upload(d_expert_counts, std::vector<int64_t>(kExperts, 777), stream);
    Ok(moe_ep_commit_geometry(worker, 7, kR, tokens), "commit_geometry");
    Ok(moe_ep_dispatch(worker, d_hidden, d_ids, d_weights, tokens, rb_hidden, rb_ids, rb_weights,
                       rb_rows, d_source_counts, d_expert_counts, stream, 0),
       "moe_ep_dispatch into the receive buffers");
    Sync(stream);
    // Slots below R into step 1's layout (kRows a source; the slots past R
    // as padding, unchecked).
    const auto h = Download(rb_hidden, n * kHidden);
    const auto ids = Download(rb_ids, n * kTopK);
    const auto w = Download(rb_weights, n * kTopK);
    std::vector<uint16_t> hidden_k(rows * kHidden, 0);
    std::vector<int32_t> ids_k(rows * kTopK, invalid);
    std::vector<float> weights_k(rows * kTopK, 0.0f);
    for (int s = 0; s < world; ++s) {
      for (int j = 0; j < kR; ++j) {
        const int64_t from = s * rb_rows + j;
        const int64_t to = s * kRows + j;
        std::copy_n(&h[from * kHidden], kHidden, &hidden_k[to * kHidden]);
        std::copy_n(&ids[from * kTopK], kTopK, &ids_k[to * kTopK]);
        std::copy_n(&w[from * kTopK], kTopK, &weights_k[to * kTopK]);
      }
    }
    check_step("combine of a dispatch into the receive buffers", hidden_k, ids_k, weights_k,
               Download(d_source_counts, world), Download(d_expert_counts, local), kR);
    Ok(moe_ep_check_step(worker, 0), "moe_ep_check_step after the receive buffers");
  }
  if (!host_plane) {
    CUDA(cudaGraphExecDestroy(exec));
    CUDA(cudaGraphDestroy(graph));
    CUDA(cudaStreamDestroy(stream));
  }
  for (void* p : std::initializer_list<void*>{
           d_hidden, d_ids, d_weights, d_recv_hidden, d_recv_ids, d_recv_weights, d_source_counts,
           d_expert_counts, d_expert_out, d_output, d_local_tokens, d_token_counts}) {
    Free(p);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: engine_embedded MOE_EP_CLI [nccl|one-sided|gloo] [world 1-4]\n");
    return 2;
  }
  const std::string plane = argc > 2 ? argv[2] : "nccl";
  const int world = argc > 3 ? std::atoi(argv[3]) : 1;
  if (world < 1 || world > 4) {
    std::fprintf(stderr, "engine_embedded: world must be 1 to 4, got %s\n", argv[3]);
    return 2;
  }
  if (plane != "nccl" && plane != "one-sided" && plane != "gloo") {
    std::fprintf(stderr, "engine_embedded: plane must be nccl, one-sided or gloo, got %s\n",
                 plane.c_str());
    return 2;
  }
  host_plane = plane == "gloo";
  one_sided = plane == "one-sided";
  // Ranks 1 .. world - 1 are children forked before CUDA is touched; each
  // sends its worker's address to the parent (rank 0) on its own pipe, and
  // the parent forms the group in rank order.
  std::vector<int> address_fd(world, -1);
  std::vector<pid_t> children;
  int rank = 0;
  int my_pipe = -1;
  for (int r = 1; r < world; ++r) {
    int fds[2] = {-1, -1};
    if (pipe(fds) != 0) return 1;
    const pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
      rank = r;
      my_pipe = fds[1];
      close(fds[0]);
      break;
    }
    close(fds[1]);
    address_fd[r] = fds[0];
    children.push_back(pid);
  }
  const bool is_child = rank > 0;
  auto finish_children = [&] {
    for (pid_t pid : children) waitpid(pid, nullptr, 0);
  };
  // NCCL refuses two ranks on one device: rank r takes device r.
  const int needed = host_plane ? 0 : (plane == "nccl" ? world : 1);
  const int device = plane == "nccl" ? rank : 0;
  int devices = 0;
  if (needed > 0 && (cudaGetDeviceCount(&devices) != cudaSuccess || devices < needed)) {
    std::printf("SKIP: %d CUDA device(s) visible; the %s plane's %d rank(s) need %d\n", devices,
                plane.c_str(), world, needed);
    if (is_child) _exit(77);
    finish_children();
    return 77;
  }
  const std::string plane_flag = "--gpu-data-plane=" + plane;
  const std::string device_flag = "--device=" + std::to_string(device);
  std::vector<const char*> args = {"--listen=127.0.0.1:0", "--log-level=warn"};
  if (host_plane) {
    args.push_back("--backend=gloo");
  } else {
    args.insert(args.end(), {"--backend=nccl", device_flag.c_str(), plane_flag.c_str()});
  }
  if (one_sided) args.push_back("--onesided-receive-buffers");
  moe_ep_worker* worker = nullptr;
  if (!Ok(moe_ep_worker_start(static_cast<int32_t>(args.size()), args.data(), &worker),
          "moe_ep_worker_start")) {
    if (is_child) _exit(1);
    finish_children();
    return 1;
  }
  const char* address = nullptr;
  Ok(moe_ep_worker_address(worker, &address), "moe_ep_worker_address");
  std::string targets = address;
  if (is_child) {
    char line[256] = {0};
    std::snprintf(line, sizeof(line), "%s\n", address);
    if (write(my_pipe, line, std::strlen(line)) < 0) _exit(1);
    close(my_pipe);
  }
  for (int r = 1; r < world && !is_child; ++r) {
    char line[256] = {0};
    size_t got = 0;
    while (got < sizeof(line) - 1) {
      const ssize_t n = read(address_fd[r], line + got, sizeof(line) - 1 - got);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
      if (std::strchr(line, '\n') != nullptr) break;
    }
    close(address_fd[r]);
    if (char* nl = std::strchr(line, '\n')) *nl = '\0';
    targets += std::string(",") + line;
  }
  if (!is_child) {
    std::printf("data plane: %s, %d rank(s)\n", plane.c_str(), world);
    const std::string up = std::string(argv[1]) + " up --targets " + targets + " --backend " +
                           (host_plane ? "gloo" : "nccl") + " --hidden " + std::to_string(kHidden) +
                           " --num-experts " + std::to_string(kExperts) + " --top-k " +
                           std::to_string(kTopK) + " --capacity " + std::to_string(kCapacity) +
                           " --load-experts identity > /dev/null";
    if (std::system(up.c_str()) != 0) {
      std::fprintf(stderr, "FATAL: %s failed\n", up.c_str());
      for (pid_t pid : children) kill(pid, SIGKILL);
      finish_children();
      return 1;
    }
  }
  if (Ok(moe_ep_worker_wait_ready_for_steps(worker, MOE_EP_STEPS_WORKER_EXPERTS, 60000),
         "moe_ep_worker_wait_ready_for_steps")) {
    RunRank(worker, world, device);
  }
  Ok(moe_ep_worker_stop(worker, 1000), "moe_ep_worker_stop");
  if (is_child) {
    std::printf("rank %d %s: %d failure(s)\n", rank, failures ? "FAIL" : "PASS", failures);
    std::fflush(stdout);
    _exit(failures ? 1 : 0);
  }
  for (size_t i = 0; i < children.size(); ++i) {
    int child_status = 0;
    if (waitpid(children[i], &child_status, 0) != children[i] || !WIFEXITED(child_status) ||
        WEXITSTATUS(child_status) != 0) {
      std::fprintf(stderr, "FAIL: rank %zu (pid %d) exited with status %d\n", i + 1,
                   static_cast<int>(children[i]), child_status);
      ++failures;
    }
  }
  std::printf("%s: %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
  return failures ? 1 : 0;
}
