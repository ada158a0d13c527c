#include "server/group_formation.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "gloo/rendezvous/hash_store.h"
#include "server/backend_selection.h"
#include "server/grpc_store.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {

int64_t GenerationLimit(int64_t max_generation_used, int64_t max_generation) {
  const int64_t next = max_generation_used < std::numeric_limits<int64_t>::max()
                           ? max_generation_used + 1
                           : max_generation_used;
  return std::max(max_generation, next);
}

absl::Status CheckJoin(const JoinedGroup& current, int64_t max_generation_used,
                       int64_t max_generation, const JoinArgs& args, bool* same_group) {
  *same_group = false;
  const int64_t limit = GenerationLimit(max_generation_used, max_generation);
  if (args.generation > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("generation: expected <= ", limit, " (--max-generation ", max_generation,
                     ", or 1 + the highest generation this worker saw, ", max_generation_used,
                     "), got ", args.generation,
                     "; form each group at 1 + the highest GetStatus.max_generation_seen "
                     "of its workers"));
  }
  if (current.joined) {
    const JoinArgs& joined = *current.args;
    if (args == joined && !current.broken) {
      *same_group = true;
      return absl::OkStatus();
    }
    if (args == joined) {
      return absl::FailedPreconditionError(
          absl::StrCat("Join: the group of generation ", joined.generation, " is broken (",
                       current.broken_reason, "); re-join with a new generation"));
    }
    if (args.generation == joined.generation) {
      return absl::FailedPreconditionError(
          absl::StrCat("Join: already joined generation ", joined.generation, " as rank ",
                       joined.rank, " of ", joined.world_size,
                       " with different arguments; Leave first or join with a new generation"));
    }
  }
  if (args.generation <= max_generation_used) {
    return absl::FailedPreconditionError(
        absl::StrCat("generation: ", args.generation,
                     " was already used by this worker (rendezvous keys are "
                     "write-once); join with a generation > ",
                     max_generation_used));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DataPlane>> FormJoinedGroup(const JoinArgs& args, int device,
                                                           int onesided_sm_budget,
                                                           bool onesided_receive_buffers,
                                                           absl::Time call_deadline) {
  std::shared_ptr<gloo::rendezvous::Store> store;
  if (args.rendezvous_address.empty() || args.rejoin) {
    // World 1, or a returning rank that forms a group of itself alone.
    store = std::make_shared<gloo::rendezvous::HashStore>();  // nobody to meet
  } else {
    const absl::Duration meet =
        std::clamp(call_deadline - absl::Now(), absl::Milliseconds(1), args.timeout);
    store = std::make_shared<GrpcStore>(args.rendezvous_address, meet, args.rendezvous_secret);
  }
  spdlog::info("Join: forming {} group generation {} as rank {} of {} via {}", args.backend,
               args.generation, args.rank, args.world_size,
               args.rendezvous_address.empty() || args.rejoin ? "an in-process store (alone)"
                                                              : args.rendezvous_address);
  DataPlaneGroup group;
  ASSIGN_OR_RETURN(group.plane, PlaneRequestOf(args.backend, args.gpu_data_plane));
  group.world_size = args.world_size;
  group.rank = args.rank;
  group.generation = args.generation;
  group.timeout = args.timeout;
  group.rendezvous_address = args.rendezvous_address;
  group.data_plane_host = args.data_plane_host;
  group.device = device;
  group.onesided_sm_budget = onesided_sm_budget;
  group.onesided_receive_buffers = onesided_receive_buffers;
  group.rendezvous_addresses = args.rendezvous_addresses;
  group.rendezvous_secret = args.rendezvous_secret;
  group.rejoin = args.rejoin;
  return FormDataPlane(group, store);
}

}  // namespace moe_ep::server
