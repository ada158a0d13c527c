// A hostile client against real moe-ep-worker processes on loopback (issue
// 13; one-rank calls: issue 29 item 5): valid requests of every Worker and
// Rendezvous RPC, mutated field by field (protobuf reflection: boundary
// numbers, long strings, huge shapes) and byte by byte (flips, cuts,
// insertions, random bytes), sent as raw bytes through a generic stub.
// After every call it asserts:
//   - the worker answered before the call's deadline plus a slack (no hang);
//   - the code is one the RPC documents in proto/moe_ep/v1/*.proto (or
//     INTERNAL for bytes that do not parse as the request);
//   - a rejected call changed nothing GetStatus shows on any rank of the
//     group (counters.errors aside: the snapshot after the call against the
//     one after the previous call), except one that the client's deadline
//     cut off: that DEADLINE_EXCEEDED does not say whether the server
//     finished (gRPC's semantics), so after one the harness waits until
//     GetStatus settles before the next call;
//   - every worker still answers (no crash), and at the end its process runs.
// Two tests share the loop:
//   - Fuzz.MutatedRequests...: each worker is its own group of one (every
//     collective completes on it), so calls reach the handlers' work at
//     loopback speed. MOE_EP_FUZZ_REQUESTS (default 20000),
//     MOE_EP_FUZZ_WORKERS (default 4), MOE_EP_FUZZ_SECONDS (a time budget).
//   - Fuzz.OneRankCalls...: workers form groups of MOE_EP_FUZZ_GROUP_SIZE
//     (default 2) and each request goes to one rank of its group only, so a
//     collective's local checks answer at once and a valid one ends at its
//     deadline in the arrival round (issue 29 items 1-2); every 64 calls a
//     SyncTokenCounts of every rank checks that the group still serves.
//     MOE_EP_FUZZ_GROUP_REQUESTS (default 400), MOE_EP_FUZZ_GROUP_WORKERS
//     (default 4), MOE_EP_FUZZ_GROUP_DEADLINE_MS (default 800: a valid
//     one-rank collective costs one deadline), MOE_EP_FUZZ_GROUP_SECONDS.
// After an accepted call moved or broke a group (not ALLOCATED at geometry
// epoch 1 in its generation, group_broken, a rank masked) it is formed
// again above every rank's max_generation_seen (a re-form). Both print the
// rate, the CPU per request, each RPC's share of each code and where the
// client threads' time went; MOE_EP_FUZZ_SEED sets the seed. The long runs
// of bench/results/fuzz.md and bench/results/fuzz-long/ used this test.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/local_cluster.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/reflection.h"
#include "google/protobuf/stubs/common.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "moe_ep/v1/rendezvous.grpc.pb.h"
#include "moe_ep/v1/worker.grpc.pb.h"

namespace moe_ep::testing {
namespace {

namespace v1 = ::moe_ep::v1;
namespace pb = ::google::protobuf;
using grpc::StatusCode;

constexpr auto kSlack = std::chrono::milliseconds(3000);
// A DEADLINE_EXCEEDED that arrives this much before the call's deadline was
// the server's own answer, not the client giving up.
constexpr auto kServerMargin = std::chrono::milliseconds(200);
// Set-up calls and the group check (every rank at once) under load.
constexpr auto kSetUpDeadline = std::chrono::milliseconds(20000);
// The collective timeout of a group the one-rank test forms (JoinRequest).
constexpr int64_t kGroupJoinTimeoutMs = 5000;
// The one-rank test checks that the group still serves every this many calls.
constexpr int64_t kGroupCheckEvery = 64;
// The workers' --max-generation (passed explicitly). A Join at or above it
// is not sent to one rank of a group of several (bench/results/fuzz-long/
// README.md, run 7): once one rank alone saw generation M = --max-generation,
// it accepts only generations above M while its peers accept at most M
// (server/group_formation.cc GenerationLimit), so the group can never form
// again until its workers restart.
constexpr int64_t kMaxGeneration = int64_t{1} << 53;

// User + system CPU seconds of process `pid` so far (/proc/PID/stat), or 0
// when it cannot be read.
double ProcessCpuSeconds(pid_t pid) {
  std::ifstream file(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces) start past ')'.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::atof(field.c_str());  // utime, stime
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  return value == nullptr ? fallback : std::atoll(value);
}

// One RPC: its method path, a valid request, the codes it documents and
// whether it is a collective (a valid one sent to one rank of a group of
// several waits in the arrival round until its deadline).
struct Rpc {
  std::string method;
  std::unique_ptr<pb::Message> valid;
  std::set<StatusCode> codes;
  bool collective = false;
};

// The group the valid requests are made for: `world` ranks, this one
// `rank`, every rank's address and the joined generation. world 1 is a
// group of one whose valid Join (generation 1000) forms a new group.
struct GroupShape {
  int world = 1;
  int rank = 0;
  std::vector<std::string> addresses;
  int64_t generation = 1000;
};

// The valid requests of every Worker and Rendezvous RPC for `shape`. The
// list is the same, in the same order, for every shape.
std::vector<Rpc> MakeRpcs(const GroupShape& shape) {
  const bool group = shape.world > 1;
  // The codes every Worker RPC may return (worker.proto, "Codes").
  const std::set<StatusCode> common = {StatusCode::OK,
                                       StatusCode::UNAVAILABLE,
                                       StatusCode::DEADLINE_EXCEEDED,
                                       StatusCode::CANCELLED,
                                       StatusCode::RESOURCE_EXHAUSTED,
                                       StatusCode::INVALID_ARGUMENT,
                                       StatusCode::FAILED_PRECONDITION};
  auto with = [&](const std::set<StatusCode>& extra) {
    std::set<StatusCode> all = common;
    all.insert(extra.begin(), extra.end());
    return all;
  };
  const std::set<StatusCode> collective = {StatusCode::ABORTED};
  std::vector<Rpc> rpcs;
  auto add = [&](const std::string& method, pb::Message* valid, std::set<StatusCode> codes,
                 bool is_collective) {
    rpcs.push_back(
        Rpc{method, std::unique_ptr<pb::Message>(valid), std::move(codes), is_collective});
  };
  add("/moe_ep.v1.Worker/GetStatus", new v1::GetStatusRequest, with({}), false);
  auto* join = new v1::JoinRequest;
  join->set_world_size(shape.world);
  join->set_backend("gloo");
  join->set_generation(shape.generation);
  if (group) {
    // The group's own Join: idempotent, so mutations reach its checks.
    join->set_rank(shape.rank);
    join->set_rendezvous_address(shape.addresses[0]);
    for (const std::string& address : shape.addresses) join->add_rendezvous_addresses(address);
    join->set_timeout_ms(kGroupJoinTimeoutMs);
  } else {
    join->set_timeout_ms(1000);
  }
  // A Join of a new generation is a collective of its ranks.
  add("/moe_ep.v1.Worker/Join", join, with({StatusCode::ABORTED}), !group);
  auto* leave = new v1::LeaveRequest;
  if (group) leave->set_generation(shape.generation);
  add("/moe_ep.v1.Worker/Leave", leave, with({}), false);
  auto* configure = new v1::ConfigureLayersRequest;
  configure->mutable_layout()->set_tp_size(shape.world);
  configure->mutable_layout()->set_attn_dp_size(1);
  configure->set_a2a_enabled(true);
  v1::ModelDescription* model = configure->mutable_model();
  model->set_name("fuzz");
  model->set_hidden_size(8);
  model->set_num_layers(2);
  model->set_num_experts(4);
  model->set_top_k(2);
  model->set_moe_intermediate_size(8);
  model->add_sparse_layers(true);
  model->add_sparse_layers(false);
  add("/moe_ep.v1.Worker/ConfigureLayers", configure, with(collective), true);
  auto* allocate = new v1::AllocateWorkspaceRequest;
  allocate->set_hidden_size(8);
  allocate->set_top_k(2);
  allocate->set_num_experts(4);
  allocate->set_capacity_tokens(16);
  allocate->add_cuda_graph_buckets(4);
  allocate->add_cuda_graph_buckets(16);
  allocate->set_redundant_slots_per_rank(1);  // room for InstallPlacement's replica
  add("/moe_ep.v1.Worker/AllocateWorkspace", allocate, with(collective), true);
  auto* load = new v1::LoadExpertsRequest;
  load->set_layer(0);
  load->set_kind(v1::EXPERT_KIND_SWIGLU);
  load->set_seed(3);
  load->set_intermediate_size(8);
  load->set_name_pattern("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight");
  add("/moe_ep.v1.Worker/LoadExperts", load,
      with({StatusCode::PERMISSION_DENIED, StatusCode::NOT_FOUND, StatusCode::DATA_LOSS,
            StatusCode::INTERNAL}),
      false);
  // DESIGN §15: 4 experts on ceil(4 / world) + 1 slots a rank; slot s of
  // rank r holds expert (r * slots + s) mod 4, so every expert has a replica
  // (world 1: {0, 1, 2, 3, 0}).
  auto* placement = new v1::InstallPlacementRequest;
  placement->set_layer(0);
  const int slots = (4 + shape.world - 1) / shape.world + 1;
  for (int r = 0; r < shape.world; ++r) {
    v1::PlacementRank* rank = placement->add_ranks();
    for (int s = 0; s < slots; ++s) rank->add_slot_experts((r * slots + s) % 4);
  }
  add("/moe_ep.v1.Worker/InstallPlacement", placement, with(collective), true);
  auto* load_stats = new v1::GetExpertLoadRequest;
  load_stats->set_layer(0);
  load_stats->set_reset(true);
  add("/moe_ep.v1.Worker/GetExpertLoad", load_stats, with({}), false);
  auto* sync = new v1::SyncTokenCountsRequest;
  sync->set_epoch(1);
  sync->set_local_tokens(3);
  add("/moe_ep.v1.Worker/SyncTokenCounts", sync, with(collective), true);
  auto* commit = new v1::CommitGeometryRequest;
  commit->set_epoch(1);
  commit->set_runtime_max_tokens_per_rank(4);
  commit->set_local_tokens(3);
  add("/moe_ep.v1.Worker/CommitGeometry", commit, with({}), false);
  auto* forward = new v1::ForwardRequest;
  forward->set_layer(0);
  forward->set_epoch(1);
  v1::Tensor* hidden = forward->mutable_hidden_states();
  hidden->set_dtype(v1::DTYPE_BF16);
  hidden->add_shape(3);
  hidden->add_shape(8);
  hidden->set_data(std::string(3 * 8 * 2, '\x3f'));
  v1::Tensor* ids = forward->mutable_topk_ids();
  ids->set_dtype(v1::DTYPE_INT32);
  ids->add_shape(3);
  ids->add_shape(2);
  const int32_t id_values[6] = {0, 1, 2, 3, 1, -1};
  ids->set_data(reinterpret_cast<const char*>(id_values), sizeof(id_values));
  v1::Tensor* weights = forward->mutable_topk_weights();
  weights->set_dtype(v1::DTYPE_FP32);
  weights->add_shape(3);
  weights->add_shape(2);
  const float weight_values[6] = {0.5f, 0.5f, 0.25f, 0.75f, 1.0f, 0.0f};
  weights->set_data(reinterpret_cast<const char*>(weight_values), sizeof(weight_values));
  add("/moe_ep.v1.Worker/Forward", forward, with(collective), true);
  auto* bench = new v1::BenchmarkRequest;
  bench->set_tokens_per_rank(4);
  bench->set_hidden_size(8);
  bench->set_top_k(2);
  bench->set_num_experts(4);
  bench->set_routing("skewed");
  bench->set_iterations(2);
  bench->set_warmup(1);
  add("/moe_ep.v1.Worker/Benchmark", bench, with(collective), true);
  auto* layers = new v1::ForwardLayersRequest;
  layers->set_epoch(1);
  layers->mutable_stack()->set_num_layers(2);
  layers->mutable_stack()->set_dense_intermediate_size(8);
  v1::Tensor* tokens = layers->mutable_tokens();
  tokens->set_dtype(v1::DTYPE_FP32);
  tokens->add_shape(2);
  tokens->add_shape(8);
  tokens->set_data(std::string(2 * 8 * 4, '\0'));
  add("/moe_ep.v1.Worker/ForwardLayers", layers,
      with({StatusCode::ABORTED, StatusCode::UNIMPLEMENTED}), true);
  auto* rejoin = new v1::RejoinRequest;
  rejoin->set_generation(shape.generation);
  rejoin->set_mask_round(1);
  rejoin->add_masked_ranks(1);
  rejoin->add_ranks(1);
  add("/moe_ep.v1.Worker/Rejoin", rejoin, with({StatusCode::ABORTED, StatusCode::UNIMPLEMENTED}),
      true);
  auto* lease = new v1::LeaseRequest;
  lease->mutable_claim()->set_owner_id("fuzz");
  lease->mutable_claim()->set_ttl_ms(1000);
  add("/moe_ep.v1.Worker/Lease", lease, with({}), false);
  // The workers run with --enable-echo, so Echo reaches its tensor checks.
  auto* echo = new v1::EchoRequest;
  v1::Tensor* echoed = echo->mutable_tensor();
  echoed->set_dtype(v1::DTYPE_FP32);
  echoed->add_shape(2);
  echoed->add_shape(8);
  echoed->set_data(std::string(2 * 8 * 4, '\0'));
  add("/moe_ep.v1.Worker/Echo", echo, with({StatusCode::UNIMPLEMENTED}), false);
  // Rendezvous (rendezvous.proto): keys of the group's generation, so a
  // valid call passes the store's generation check.
  const std::string prefix = absl::StrCat("gen", shape.generation, "/");
  const std::set<StatusCode> store = {StatusCode::OK,
                                      StatusCode::INVALID_ARGUMENT,
                                      StatusCode::ALREADY_EXISTS,
                                      StatusCode::RESOURCE_EXHAUSTED,
                                      StatusCode::UNAVAILABLE,
                                      StatusCode::FAILED_PRECONDITION,
                                      StatusCode::PERMISSION_DENIED,
                                      StatusCode::DEADLINE_EXCEEDED,
                                      StatusCode::CANCELLED};
  auto* set = new v1::SetRequest;
  set->set_key(prefix + "fuzz");
  set->set_value("value");
  add("/moe_ep.v1.Rendezvous/Set", set, store, false);
  auto* get = new v1::GetRequest;
  get->set_key(prefix + "fuzz");
  get->set_timeout_ms(10);
  add("/moe_ep.v1.Rendezvous/Get", get, store, false);
  auto* wait = new v1::WaitRequest;
  wait->add_keys(prefix + "a");
  wait->add_keys(prefix + "b");
  wait->set_timeout_ms(10);
  add("/moe_ep.v1.Rendezvous/Wait", wait, store, false);
  // A round far above the calls the group numbers, so fuzzed arrivals and
  // refusals stay out of the group's own rounds.
  auto* arrive = new v1::ArriveRequest;
  arrive->set_round(prefix + "arrive/0/999999");
  arrive->set_rank(shape.rank);
  for (int r = 0; r < shape.world; ++r) arrive->add_members(r);
  arrive->set_action(v1::ArriveRequest::ACTION_ARRIVE);
  arrive->set_timeout_ms(10);
  arrive->set_lapses_in_ms(10);
  arrive->set_refusal("INVALID_ARGUMENT: fuzz");
  arrive->set_refusal_ttl_ms(10);
  if (!shape.addresses.empty()) arrive->set_address(shape.addresses[shape.rank]);
  std::set<StatusCode> arrive_codes = store;
  arrive_codes.erase(StatusCode::ALREADY_EXISTS);
  add("/moe_ep.v1.Rendezvous/Arrive", arrive, arrive_codes, false);
  return rpcs;
}

// Field-level mutations through reflection.
class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  std::string Mutate(const pb::Message& valid) {
    std::unique_ptr<pb::Message> message(valid.New());
    message->CopyFrom(valid);
    const int field_edits = Pick(4);
    for (int i = 0; i < field_edits; ++i) MutateField(message.get(), 0);
    std::string bytes = message->SerializeAsString();
    switch (Pick(6)) {
      case 0:  // bytes as they are
      case 1:
        break;
      case 2:
        FlipBytes(&bytes);
        break;
      case 3:
        if (!bytes.empty()) bytes.resize(Pick(bytes.size()));
        break;
      case 4:
        bytes.insert(Pick(bytes.size() + 1), RandomBytes(1 + Pick(16)));
        break;
      default:
        bytes = RandomBytes(Pick(64));
        break;
    }
    return bytes;
  }

 private:
  size_t Pick(size_t n) {
    return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_);
  }

  int64_t Interesting() {
    static const int64_t values[] = {0,
                                     1,
                                     -1,
                                     2,
                                     3,
                                     7,
                                     8,
                                     1000,
                                     1001,
                                     65536,
                                     int64_t{1} << 31,
                                     std::numeric_limits<int32_t>::max(),
                                     std::numeric_limits<int32_t>::min(),
                                     std::numeric_limits<int64_t>::max(),
                                     std::numeric_limits<int64_t>::min(),
                                     int64_t{1} << 53,
                                     (int64_t{1} << 53) + 1};
    if (Pick(4) == 0) return static_cast<int64_t>(rng_());
    return values[Pick(sizeof(values) / sizeof(values[0]))];
  }

  std::string RandomBytes(size_t n) {
    std::string out(n, '\0');
    for (char& c : out) c = static_cast<char>(rng_());
    return out;
  }

  void FlipBytes(std::string* bytes) {
    if (bytes->empty()) return;
    const int flips = 1 + Pick(4);
    for (int i = 0; i < flips; ++i)
      (*bytes)[Pick(bytes->size())] ^= static_cast<char>(1 << Pick(8));
  }

  std::string InterestingString() {
    static const char* values[] = {"",
                                   "gloo",
                                   "nccl",
                                   "auto",
                                   "x",
                                   "uniform",
                                   "skewed",
                                   "127.0.0.1:1",
                                   "/etc/passwd",
                                   "/dev/zero",
                                   "/tmp",
                                   "gen1000/",
                                   "{layer}{expert}{proj}",
                                   "\xff\xfe"};
    switch (Pick(4)) {
      case 0:
        return std::string(1 + Pick(20000), static_cast<char>('a' + Pick(26)));
      case 1:
        return RandomBytes(Pick(32));
      default:
        return values[Pick(sizeof(values) / sizeof(values[0]))];
    }
  }

  void MutateField(pb::Message* message, int depth) {
    const pb::Descriptor* descriptor = message->GetDescriptor();
    if (descriptor->field_count() == 0) return;
    const pb::FieldDescriptor* field = descriptor->field(Pick(descriptor->field_count()));
    const pb::Reflection* r = message->GetReflection();
    if (field->is_repeated()) {
      if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) return;
      const int action = Pick(3);
      if (action == 0) {
        r->ClearField(message, field);
        return;
      }
      const int adds = action == 1 ? 1 : static_cast<int>(Pick(3000));
      for (int i = 0; i < adds; ++i) AddRepeated(message, field, r);
      return;
    }
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT32:
        r->SetInt32(message, field, static_cast<int32_t>(Interesting()));
        break;
      case pb::FieldDescriptor::CPPTYPE_INT64:
        r->SetInt64(message, field, Interesting());
        break;
      case pb::FieldDescriptor::CPPTYPE_UINT32:
        r->SetUInt32(message, field, static_cast<uint32_t>(Interesting()));
        break;
      case pb::FieldDescriptor::CPPTYPE_UINT64:
        r->SetUInt64(message, field, static_cast<uint64_t>(Interesting()));
        break;
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        r->SetBool(message, field, Pick(2) == 1);
        break;
      case pb::FieldDescriptor::CPPTYPE_FLOAT:
        r->SetFloat(message, field, Pick(2) ? -1.0f : std::numeric_limits<float>::infinity());
        break;
      case pb::FieldDescriptor::CPPTYPE_DOUBLE:
        r->SetDouble(message, field, -1.0);
        break;
      case pb::FieldDescriptor::CPPTYPE_ENUM:
        r->SetEnumValue(message, field, static_cast<int>(Interesting() % 8));
        break;
      case pb::FieldDescriptor::CPPTYPE_STRING:
        r->SetString(message, field, InterestingString());
        break;
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        if (depth < 3) MutateField(r->MutableMessage(message, field), depth + 1);
        break;
    }
  }

  void AddRepeated(pb::Message* message, const pb::FieldDescriptor* field,
                   const pb::Reflection* r) {
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT64:
        r->AddInt64(message, field, Pick(2) ? Interesting() : static_cast<int64_t>(Pick(64)));
        break;
      case pb::FieldDescriptor::CPPTYPE_INT32:
        r->AddInt32(message, field, static_cast<int32_t>(Interesting()));
        break;
      case pb::FieldDescriptor::CPPTYPE_BOOL:
        r->AddBool(message, field, Pick(2) == 1);
        break;
      case pb::FieldDescriptor::CPPTYPE_STRING:
        r->AddString(message, field,
                     Pick(8) ? "gen1000/k" + std::to_string(Pick(100000)) : InterestingString());
        break;
      default:
        break;
    }
  }

  std::mt19937_64 rng_;
};

// One worker under fuzz: raw calls, a GetStatus snapshot, the slot barrier
// and a lease release.
class Target {
 public:
  explicit Target(const std::string& address)
      : channel_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        generic_(channel_),
        worker_(v1::Worker::NewStub(channel_)) {}

  grpc::Status Raw(const std::string& method, const std::string& bytes,
                   std::chrono::milliseconds deadline, std::chrono::milliseconds* took,
                   std::string* response_bytes = nullptr) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::ClientContext context;
    const auto start = std::chrono::steady_clock::now();
    context.set_deadline(std::chrono::system_clock::now() + deadline);
    grpc::Status status;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    generic_.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                       [&](grpc::Status s) {
                         std::lock_guard<std::mutex> lock(mu);
                         status = std::move(s);
                         done = true;
                         cv.notify_one();
                       });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
    *took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                  start);
    if (response_bytes != nullptr && status.ok()) {
      std::vector<grpc::Slice> slices;
      if (response.Dump(&slices).ok()) {
        response_bytes->clear();
        for (const grpc::Slice& s : slices) {
          response_bytes->append(reinterpret_cast<const char*>(s.begin()), s.size());
        }
      }
    }
    return status;
  }

  // GetStatus without the counters a call may bump and the lease's time
  // left (it runs down between two snapshots).
  bool Snapshot(v1::GetStatusResponse* status) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!worker_->GetStatus(&context, v1::GetStatusRequest(), status).ok()) return false;
    status->mutable_counters()->set_errors(0);
    status->set_lease_remaining_ms(0);
    return true;
  }

  // A call that takes this worker's collective slot and is then refused
  // (SyncTokenCounts with local_tokens -1: INVALID_ARGUMENT, or
  // FAILED_PRECONDITION outside a group), changing nothing; it returns only
  // after whatever held the slot released it.
  grpc::Status SlotBarrier() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::SyncTokenCountsRequest request;
    request.set_epoch(1);
    request.set_local_tokens(-1);
    v1::SyncTokenCountsResponse response;
    return worker_->SyncTokenCounts(&context, request, &response);
  }

  // Gives back a lease an accepted mutated call took (its owner id is in
  // GetStatus), so later unclaimed calls reach their own checks.
  bool ReleaseLease(const std::string& owner) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::LeaseRequest request;
    request.mutable_claim()->set_owner_id(owner);
    request.set_release(true);
    v1::LeaseResponse response;
    return worker_->Lease(&context, request, &response).ok();
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  grpc::GenericStub generic_;
  std::unique_ptr<v1::Worker::Stub> worker_;
};

// The valid request of the RPC whose method ends in `name`.
const pb::Message& Valid(const std::vector<Rpc>& rpcs, const std::string& name) {
  for (const Rpc& rpc : rpcs) {
    if (absl::EndsWith(rpc.method, name)) return *rpc.valid;
  }
  ADD_FAILURE() << "no RPC " << name;
  return *rpcs.front().valid;
}

// One group under fuzz: its workers (rank r at addresses[r]), the valid
// requests of each rank for the joined generation, and the set-up that forms
// the group again above every generation its ranks saw.
class Group {
 public:
  explicit Group(const std::vector<std::string>& addresses) : addresses_(addresses) {
    for (const std::string& address : addresses)
      targets_.push_back(std::make_unique<Target>(address));
    MakeValid(1000);
  }

  int world() const { return static_cast<int>(targets_.size()); }
  Target& target(int rank) { return *targets_[rank]; }
  const std::vector<Rpc>& rpcs(int rank) const { return rpcs_[rank]; }

  // fn(rank) on every rank at once (collectives need all ranks in).
  template <typename Fn>
  std::vector<grpc::Status> OnEveryRank(Fn fn) {
    std::vector<grpc::Status> out(targets_.size());
    if (targets_.size() == 1) {
      out[0] = fn(0);
      return out;
    }
    std::vector<std::thread> threads;
    threads.reserve(targets_.size());
    for (int r = 0; r < world(); ++r) threads.emplace_back([&, r] { out[r] = fn(r); });
    for (std::thread& t : threads) t.join();
    return out;
  }

  // Snapshots every rank; false (and `*failed` the rank) when one does not
  // answer.
  bool SnapshotAll(std::vector<v1::GetStatusResponse>* status, int* failed) {
    status->resize(targets_.size());
    for (int r = 0; r < world(); ++r) {
      if (!targets_[r]->Snapshot(&(*status)[r])) {
        *failed = r;
        return false;
      }
    }
    return true;
  }

  // Whether an accepted call moved or broke the group (then the fuzzer forms
  // it again, so calls keep reaching the checks of a serving group).
  bool Moved(const std::vector<v1::GetStatusResponse>& status) const {
    for (const v1::GetStatusResponse& s : status) {
      if (s.state() != v1::WORKER_STATE_ALLOCATED || s.world_size() != world() ||
          s.geometry_epoch() != 1 || s.generation() != generation_ || s.group_broken() ||
          s.masked_ranks_size() > 0 || s.mask_round() != 0) {
        return true;
      }
    }
    return false;
  }

  // Join (1 + the highest generation any rank saw), ConfigureLayers,
  // AllocateWorkspace, LoadExperts, SyncTokenCounts, CommitGeometry of the
  // valid requests on every rank at once (looked up by name: an RPC added to
  // MakeRpcs must not shift the steps), then checks that every rank is
  // ALLOCATED at geometry epoch 1 in that generation and leaves the
  // snapshots in `*status`.
  bool SetUp(std::vector<v1::GetStatusResponse>* status) {
    int failed = 0;
    if (!SnapshotAll(status, &failed)) {
      ADD_FAILURE() << "set-up: rank " << failed << " does not answer GetStatus";
      return false;
    }
    int64_t top = 0;
    for (const v1::GetStatusResponse& s : *status) {
      top = std::max({top, s.generation(), s.max_generation_seen()});
    }
    generation_ = top + 1;
    // A group of one keeps its valid requests (its valid Join forms a group
    // of generation 1000); a larger group's are those of the new generation.
    if (world() > 1) MakeValid(generation_);
    std::vector<v1::JoinRequest> joins;
    for (int r = 0; r < world(); ++r) {
      joins.push_back(static_cast<const v1::JoinRequest&>(Valid(rpcs_[r], "Worker/Join")));
      joins.back().set_generation(generation_);
    }
    const std::vector<std::string> steps = {
        "Worker/Join",        "Worker/ConfigureLayers", "Worker/AllocateWorkspace",
        "Worker/LoadExperts", "Worker/SyncTokenCounts", "Worker/CommitGeometry"};
    for (const std::string& name : steps) {
      const std::vector<grpc::Status> answers = OnEveryRank([&](int r) {
        const pb::Message& request = name == "Worker/Join" ? joins[r] : Valid(rpcs_[r], name);
        std::chrono::milliseconds took;
        return targets_[r]->Raw("/moe_ep.v1." + name, request.SerializeAsString(), kSetUpDeadline,
                                &took);
      });
      for (int r = 0; r < world(); ++r) {
        if (!answers[r].ok()) {
          ADD_FAILURE() << "set-up " << name << " of generation " << generation_ << " on rank " << r
                        << ": " << answers[r].error_code() << ": " << answers[r].error_message();
          return false;
        }
      }
    }
    if (!SnapshotAll(status, &failed)) {
      ADD_FAILURE() << "set-up: rank " << failed << " does not answer GetStatus";
      return false;
    }
    if (Moved(*status)) {
      for (int r = 0; r < world(); ++r) {
        ADD_FAILURE() << "set-up of generation " << generation_ << " left rank " << r << " at {"
                      << (*status)[r].ShortDebugString() << "}, not ALLOCATED at geometry epoch 1";
      }
      return false;
    }
    return true;
  }

  // A SyncTokenCounts of every rank at once, which must pass: the group
  // still serves a collective after the one-rank calls. A refusal a rank
  // posted for a rejected call stands until that call's deadline (at most
  // server/call_arrival.h's kMaxRefusalLifetime, 2 s) and ends a round of
  // the same number with ABORTED on every rank, so ABORTED is retried.
  // Returns "" or what failed; `*retries` counts the retries.
  std::string CheckServes(int64_t* retries) {
    v1::SyncTokenCountsRequest request;
    request.set_epoch(1);
    request.set_local_tokens(3);
    const std::string bytes = request.SerializeAsString();
    for (int attempt = 0;; ++attempt) {
      std::vector<std::string> answers(targets_.size());
      const std::vector<grpc::Status> status = OnEveryRank([&](int r) {
        std::chrono::milliseconds took;
        return targets_[r]->Raw("/moe_ep.v1.Worker/SyncTokenCounts", bytes, kSetUpDeadline, &took,
                                &answers[r]);
      });
      std::string failed;
      bool only_aborted = true;
      for (int r = 0; r < world(); ++r) {
        v1::SyncTokenCountsResponse response;
        if (status[r].ok() && response.ParseFromString(answers[r]) &&
            response.token_counts_size() == world() &&
            response.runtime_max_tokens_per_rank() == 4) {
          continue;
        }
        if (status[r].error_code() != StatusCode::ABORTED) only_aborted = false;
        absl::StrAppend(&failed, " rank ", r, ": code ", status[r].error_code(), ": ",
                        status[r].error_message().substr(0, 300), " {", response.ShortDebugString(),
                        "};");
      }
      if (failed.empty()) return "";
      if (!only_aborted || attempt >= 6) return failed;
      ++*retries;
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }

 private:
  void MakeValid(int64_t generation) {
    rpcs_.clear();
    for (int r = 0; r < world(); ++r) {
      rpcs_.push_back(MakeRpcs(GroupShape{world(), r, addresses_, generation}));
    }
  }

  std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<Target>> targets_;
  std::vector<std::vector<Rpc>> rpcs_;  // [rank]
  int64_t generation_ = 0;
};

struct Findings {
  int64_t calls = 0;
  std::map<std::string, int64_t> codes;  // "method code" -> count
  std::vector<std::string> failures;
  // Where the client thread's wall time went, in ms ("call <method>",
  // "snapshot", "settle", "set-up", "group check"), and how often.
  std::map<std::string, double> wall_ms;
  std::map<std::string, int64_t> counts;
  int64_t reforms = 0;            // set-ups after an accepted call moved the group
  int64_t valid_collectives = 0;  // unmutated collectives sent to one rank of a group
  int64_t arrival_timeouts = 0;   // answers "ranks [..] did not enter <Rpc>"
  int64_t group_checks = 0;
  int64_t group_check_retries = 0;
  int64_t filtered_joins = 0;  // one-rank Joins at or above kMaxGeneration, not sent
};

// Adds the time since `start` to out->wall_ms[what].
void Charge(Findings* out, const std::string& what, std::chrono::steady_clock::time_point start) {
  out->wall_ms[what] +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  ++out->counts[what];
}

std::string Serialized(const std::vector<v1::GetStatusResponse>& status) {
  std::string out;
  for (const v1::GetStatusResponse& s : status) out += s.SerializeAsString();
  return out;
}

// Fuzzes one group (rank r at addresses[r]) with `requests` calls of
// `deadline` each, or until `stop_at` if sooner: each call goes to one rank.
void Fuzz(const std::vector<std::string>& addresses, std::chrono::milliseconds deadline,
          uint64_t seed, int64_t requests, absl::Time stop_at, Findings* out) {
  Group group(addresses);
  const int world = group.world();
  // Every rank's state before each call: the snapshots taken after the
  // previous call (or set-up). Nothing else talks to these workers, so they
  // are what a fresh GetStatus would show, at half the calls.
  std::vector<v1::GetStatusResponse> before;
  if (!group.SetUp(&before)) {
    out->failures.push_back("initial set-up failed");
    return;
  }
  Mutator mutator(seed);
  std::mt19937_64 rng(seed ^ 0x5DEECE66Dull);
  std::deque<std::string> recent;  // the last calls, for a failed group check
  auto check_serves = [&](const std::string& when) {
    const auto t0 = std::chrono::steady_clock::now();
    ++out->group_checks;
    const std::string failed = group.CheckServes(&out->group_check_retries);
    Charge(out, "group check", t0);
    if (failed.empty()) return true;
    std::string calls;
    for (const std::string& call : recent) absl::StrAppend(&calls, "\n    ", call);
    out->failures.push_back(absl::StrCat("the group stopped serving ", when, ":", failed,
                                         "\n  the calls since the last check:", calls));
    return false;
  };
  for (int64_t i = 0; i < requests && out->failures.size() < 20 && absl::Now() < stop_at; ++i) {
    // A group of one draws no rank, so its sequence is the one of the runs
    // before groups existed.
    const int rank = world == 1 ? 0 : static_cast<int>(rng() % world);
    const std::vector<Rpc>& rpcs = group.rpcs(rank);
    const Rpc& rpc = rpcs[rng() % rpcs.size()];
    const bool unmutated = rng() % 8 == 0;
    const std::string bytes =
        unmutated ? rpc.valid->SerializeAsString() : mutator.Mutate(*rpc.valid);
    if (world > 1 && rpc.method == "/moe_ep.v1.Worker/Join") {
      v1::JoinRequest join;
      if (join.ParseFromString(bytes) && join.generation() >= kMaxGeneration) {
        ++out->filtered_joins;
        continue;
      }
    }
    // An accepted Join at the top of the generation range (--max-generation)
    // no longer locks Join out: the worker then accepts 1 + the highest
    // generation it saw (issue 13 item 3), which SetUp picks.
    Target& target = group.target(rank);
    std::chrono::milliseconds took;
    auto t0 = std::chrono::steady_clock::now();
    const grpc::Status status = target.Raw(rpc.method, bytes, deadline, &took);
    Charge(out, "call " + rpc.method, t0);
    ++out->calls;
    ++out->codes[absl::StrCat(rpc.method, " ", status.error_code())];
    if (world > 1 && unmutated && rpc.collective) ++out->valid_collectives;
    if (status.error_code() == StatusCode::FAILED_PRECONDITION &&
        absl::StrContains(status.error_message(), " did not enter ")) {
      ++out->arrival_timeouts;
    }
    const std::string what = absl::StrCat(rpc.method, " to rank ", rank, " (call ", i, ")");
    recent.push_back(absl::StrCat(what, unmutated ? " unmutated" : "", ": ", status.error_code(),
                                  ": ", status.error_message().substr(0, 160)));
    if (recent.size() > kGroupCheckEvery) recent.pop_front();
    std::unique_ptr<pb::Message> parsed(rpc.valid->New());
    const bool parses = parsed->ParseFromString(bytes);
    const bool documented = rpc.codes.count(status.error_code()) > 0 ||
                            (!parses && status.error_code() == StatusCode::INTERNAL);
    if (!documented) {
      out->failures.push_back(absl::StrCat(what, " returned undocumented code ",
                                           status.error_code(), ": ",
                                           status.error_message().substr(0, 300)));
    }
    if (took > deadline + kSlack) {
      out->failures.push_back(absl::StrCat(what, " took ", took.count(), " ms, past its deadline"));
    }
    std::vector<v1::GetStatusResponse> after;
    int silent = 0;
    t0 = std::chrono::steady_clock::now();
    const bool answered_after = group.SnapshotAll(&after, &silent);
    Charge(out, "snapshot", t0);
    if (!answered_after) {
      out->failures.push_back(absl::StrCat(what, ": rank ", silent, " stopped answering after it"));
      return;
    }
    // DEADLINE_EXCEEDED from the client's own deadline does not say whether
    // the server finished (gRPC's semantics); one the server chose well
    // before that deadline (a Rendezvous wait that ran out, a request's
    // timeout_ms) is a rejection like any other.
    const bool client_gave_up =
        status.error_code() == StatusCode::DEADLINE_EXCEEDED && took >= deadline - kServerMargin;
    if (client_gave_up) {
      // The server may still finish what it accepted. Every Worker RPC that
      // changes what GetStatus shows (Lease aside) holds the collective slot
      // while it works and checks its deadline before taking it, so once a
      // call of our own has had the slot, the cut-off call is done or will
      // do nothing. Then settle for what does not take the slot.
      t0 = std::chrono::steady_clock::now();
      const grpc::Status barrier = target.SlotBarrier();
      if (barrier.error_code() != StatusCode::INVALID_ARGUMENT &&
          barrier.error_code() != StatusCode::FAILED_PRECONDITION) {
        out->failures.push_back(absl::StrCat("the slot barrier after ", what, " got code ",
                                             barrier.error_code(), ": ",
                                             barrier.error_message().substr(0, 200)));
        return;
      }
      if (!group.SnapshotAll(&after, &silent)) {
        out->failures.push_back(
            absl::StrCat(what, ": rank ", silent, " stopped answering after it"));
        return;
      }
      for (int settle = 0; settle < 40; ++settle) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        std::vector<v1::GetStatusResponse> again;
        if (!group.SnapshotAll(&again, &silent)) break;
        if (Serialized(again) == Serialized(after)) break;
        after = std::move(again);
      }
      Charge(out, "settle", t0);
    } else if (!status.ok()) {
      for (int r = 0; r < world; ++r) {
        // A Join whose formation started records its generation (by
        // design); compared on a copy, as `after` is the next call's
        // `before`.
        v1::GetStatusResponse compared = after[r];
        if (rpc.method == "/moe_ep.v1.Worker/Join" && r == rank) {
          compared.set_max_generation_seen(before[r].max_generation_seen());
        }
        if (compared.SerializeAsString() != before[r].SerializeAsString()) {
          out->failures.push_back(absl::StrCat(
              what, " was rejected (", status.error_code(), ": ",
              status.error_message().substr(0, 200), ") yet changed rank ", r, "'s status from {",
              before[r].ShortDebugString(), "} to {", after[r].ShortDebugString(), "}"));
        }
      }
    }
    for (int r = 0; r < world; ++r) {
      if (after[r].lease_owner().empty()) continue;
      if (!group.target(r).ReleaseLease(after[r].lease_owner()) ||
          !group.target(r).Snapshot(&after[r])) {
        out->failures.push_back(absl::StrCat("the lease of '", after[r].lease_owner().substr(0, 64),
                                             "' on rank ", r, " could not be released"));
        return;
      }
    }
    if (group.Moved(after)) {
      t0 = std::chrono::steady_clock::now();
      const bool set_up = group.SetUp(&after);
      Charge(out, "set-up", t0);
      ++out->reforms;
      recent.clear();
      if (!set_up) {
        out->failures.push_back(absl::StrCat("set-up after ", what, " failed"));
        return;
      }
    } else if (world > 1 && (i + 1) % kGroupCheckEvery == 0) {
      if (!check_serves(absl::StrCat("after call ", i))) {
        if (!group.SetUp(&after)) return;
        ++out->reforms;
      } else if (!group.SnapshotAll(&after, &silent)) {
        out->failures.push_back(absl::StrCat("rank ", silent, " stopped answering after a check"));
        return;
      }
      recent.clear();
    }
    before = std::move(after);
  }
  if (world > 1) check_serves("at the end");
}

struct RunOptions {
  int64_t requests = 0;
  int workers = 0;
  int group_size = 1;
  std::chrono::milliseconds deadline{1500};
  int64_t budget_s = 0;  // 0: none
  uint64_t seed = 0;
};

// Starts `workers` workers, forms them into groups of `group_size` (one
// client thread each), fuzzes them and prints the figures.
void RunFuzz(const RunOptions& run) {
  // Strings with invalid UTF-8 are part of the input; protobuf would log each.
  pb::SetLogHandler(nullptr);
  ASSERT_GE(run.group_size, 1);
  ASSERT_EQ(run.workers % run.group_size, 0)
      << run.workers << " workers do not split into groups of " << run.group_size;
  const int groups = run.workers / run.group_size;
  client::LocalClusterOptions options;
  options.num_workers = run.workers;
  options.backend = "gloo";
  options.worker_binary = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  // Up to 16 workers share the host (the long run): a cap of 256 MiB each
  // keeps accepted request-sized allocations from taking the machine's
  // memory, and makes RESOURCE_EXHAUSTED reachable at small sizes.
  options.extra_args = {"--checkpoint-dir=/tmp", "--memory-cap-bytes=268435456", "--enable-echo",
                        absl::StrCat("--max-generation=", kMaxGeneration)};
  options.stop_timeout = absl::Seconds(5);
  auto cluster = client::LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<Findings> findings(groups);
  double workers_cpu_start = 0;
  for (int w = 0; w < run.workers; ++w) workers_cpu_start += ProcessCpuSeconds((*cluster)->pid(w));
  const double client_cpu_start = ProcessCpuSeconds(getpid());
  const absl::Time start = absl::Now();
  const absl::Time stop_at =
      run.budget_s > 0 ? start + absl::Seconds(run.budget_s) : absl::InfiniteFuture();
  std::vector<std::thread> threads;
  threads.reserve(groups);
  for (int g = 0; g < groups; ++g) {
    const std::vector<std::string> addresses(
        (*cluster)->targets().begin() + g * run.group_size,
        (*cluster)->targets().begin() + (g + 1) * run.group_size);
    threads.emplace_back([&, g, addresses] {
      Fuzz(addresses, run.deadline, run.seed + g, run.requests / groups, stop_at, &findings[g]);
    });
  }
  for (std::thread& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const double client_cpu = ProcessCpuSeconds(getpid()) - client_cpu_start;
  double workers_cpu = -workers_cpu_start;
  for (int w = 0; w < run.workers; ++w) workers_cpu += ProcessCpuSeconds((*cluster)->pid(w));
  Findings all;
  for (int g = 0; g < groups; ++g) {
    const Findings& f = findings[g];
    all.calls += f.calls;
    for (const auto& [key, count] : f.codes) all.codes[key] += count;
    for (const auto& [key, ms] : f.wall_ms) all.wall_ms[key] += ms;
    for (const auto& [key, count] : f.counts) all.counts[key] += count;
    all.reforms += f.reforms;
    all.valid_collectives += f.valid_collectives;
    all.arrival_timeouts += f.arrival_timeouts;
    all.group_checks += f.group_checks;
    all.group_check_retries += f.group_check_retries;
    all.filtered_joins += f.filtered_joins;
    for (const std::string& failure : f.failures) ADD_FAILURE() << "group " << g << ": " << failure;
  }
  for (int w = 0; w < run.workers; ++w) {
    EXPECT_TRUE((*cluster)->IsRunning(w)) << "worker " << w << " exited";
  }
  const int64_t calls = all.calls;
  std::cout << "fuzz: " << calls << " requests in " << seconds << " s ("
            << static_cast<int64_t>(calls / seconds) << " requests/s), seed " << run.seed << ", "
            << run.workers << " workers in " << groups << " groups of " << run.group_size
            << ", call deadline " << run.deadline.count() << " ms\n";
  if (calls > 0) {
    std::cout << "CPU per request: " << 1e3 * client_cpu / calls << " ms client + "
              << 1e3 * workers_cpu / calls
              << " ms workers = " << 1e3 * (client_cpu + workers_cpu) / calls << " ms\n";
    const auto share = [&](int64_t n) { return absl::StrCat(n, " (", 100.0 * n / calls, " %)"); };
    std::cout << "re-forms: " << share(all.reforms) << "\n";
    if (run.group_size > 1) {
      std::cout << "unmutated collectives to one rank: " << share(all.valid_collectives)
                << "; answered \"ranks [..] did not enter\" at the deadline: "
                << share(all.arrival_timeouts) << "; group checks: " << all.group_checks << " ("
                << all.group_check_retries << " retried after ABORTED); Joins at or above "
                << "--max-generation not sent: " << all.filtered_joins << "\n";
    }
  }
  // Each RPC's codes and their share of its calls.
  std::map<std::string, int64_t> per_method;
  for (const auto& [key, count] : all.codes) per_method[key.substr(0, key.rfind(' '))] += count;
  for (const auto& [key, count] : all.codes) {
    std::cout << "  " << key << ": " << count << " ("
              << 100.0 * count / per_method[key.substr(0, key.rfind(' '))] << " %)\n";
  }
  std::cout << "wall time of the client threads (ms total, count, ms each):\n";
  for (const auto& [key, ms] : all.wall_ms) {
    std::cout << "  " << key << ": " << static_cast<int64_t>(ms) << " ms, " << all.counts[key]
              << ", " << ms / all.counts[key] << "\n";
  }
  if (run.budget_s == 0) {
    EXPECT_GE(calls, run.requests - groups);
  }
}

// Each worker its own group of one (issue 13).
TEST(Fuzz, MutatedRequestsOfEveryRpcNeverCrashHangOrChangeStateWhenRejected) {
  RunOptions run;
  run.requests = EnvInt("MOE_EP_FUZZ_REQUESTS", 20000);
  run.seed = static_cast<uint64_t>(EnvInt("MOE_EP_FUZZ_SEED", 13));
  // A long run (bench/results/fuzz.md) spreads the requests over more
  // workers and may stop at a time budget; CI uses the defaults.
  run.workers = static_cast<int>(std::max<int64_t>(1, EnvInt("MOE_EP_FUZZ_WORKERS", 4)));
  run.budget_s = EnvInt("MOE_EP_FUZZ_SECONDS", 0);
  run.group_size = 1;
  run.deadline = std::chrono::milliseconds(1500);
  RunFuzz(run);
}

// Groups of MOE_EP_FUZZ_GROUP_SIZE, each call sent to one rank only (issue
// 29 item 5): a call's local checks answer at once, a valid collective ends
// at its deadline in the arrival round with the group usable.
TEST(Fuzz, OneRankCallsToAGroupAreAnsweredInTimeAndChangeNothingWhenRejected) {
  RunOptions run;
  run.requests = EnvInt("MOE_EP_FUZZ_GROUP_REQUESTS", 400);
  run.seed = static_cast<uint64_t>(EnvInt("MOE_EP_FUZZ_SEED", 13));
  run.group_size = static_cast<int>(std::max<int64_t>(2, EnvInt("MOE_EP_FUZZ_GROUP_SIZE", 2)));
  run.workers =
      static_cast<int>(std::max<int64_t>(run.group_size, EnvInt("MOE_EP_FUZZ_GROUP_WORKERS", 4)));
  run.budget_s = EnvInt("MOE_EP_FUZZ_GROUP_SECONDS", 0);
  run.deadline = std::chrono::milliseconds(EnvInt("MOE_EP_FUZZ_GROUP_DEADLINE_MS", 800));
  RunFuzz(run);
}

// The long run's crash (bench/results/fuzz-long/README.md run 7): a Join
// whose rendezvous_secret holds a byte gRPC does not allow in a header value
// (here 0xd9 0x83, as the run sent) made the worker abort when it sent the
// secret to rank 0's store (its Join vote or refusal). It is now refused at
// once, on either rank of a group of two, and both workers keep serving.
TEST(Fuzz, JoinWithASecretThatIsNoHeaderValueIsRefusedAndTheWorkerServes) {
  client::LocalClusterOptions options;
  options.num_workers = 2;
  options.backend = "gloo";
  options.worker_binary = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  auto cluster = client::LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<std::string>& targets = (*cluster)->targets();
  for (const std::string& secret :
       {std::string("\xd9\x83"), std::string("ok\nsecret"), std::string(1025, 'w')}) {
    for (int rank = 0; rank < 2; ++rank) {
      v1::JoinRequest join;
      join.set_world_size(2);
      join.set_rank(rank);
      join.set_backend("gloo");
      join.set_generation(1);
      join.set_timeout_ms(1000);
      join.set_rendezvous_address(targets[0]);
      join.set_rendezvous_secret(secret);
      Target target(targets[rank]);
      std::chrono::milliseconds took;
      const grpc::Status status = target.Raw("/moe_ep.v1.Worker/Join", join.SerializeAsString(),
                                             std::chrono::milliseconds(5000), &took);
      EXPECT_EQ(status.error_code(), StatusCode::INVALID_ARGUMENT)
          << "rank " << rank << ": " << status.error_message();
      EXPECT_NE(status.error_message().find("rendezvous_secret"), std::string::npos)
          << status.error_message();
      EXPECT_LT(took.count(), 1000) << "rank " << rank;
      v1::GetStatusResponse after;
      ASSERT_TRUE(target.Snapshot(&after)) << "rank " << rank << " stopped answering";
      EXPECT_EQ(after.max_generation_seen(), 0) << "rank " << rank;
    }
  }
  for (int w = 0; w < 2; ++w) EXPECT_TRUE((*cluster)->IsRunning(w)) << "worker " << w;
}

}  // namespace
}  // namespace moe_ep::testing
