// moe-ep-worker: one expert-parallel MoE worker (one per rank), serving the
// moe_ep.v1.Worker and moe_ep.v1.Rendezvous services, grpc.health.v1 and
// server reflection (v1alpha and v1). It is libmoe_ep.so (server/moe_ep.h,
// the library engines embed) plus this main(): the process itself is
// moe_ep_worker_main (server/worker_main.cc; signals, the "listening on"
// line, the drain), its services server/worker_process.h. Source: DESIGN
// §8, §14.

#include <cstddef>

#include "core/thread_stack_floor.h"
#include "server/moe_ep.h"

int main(int argc, char** argv) {
  // Links this executable's pthread_attr_setstacksize floor (exported for
  // the shared libraries it loads; core/thread_stack_floor.h).
  (void)moe_ep::core::EffectiveThreadStackBytes(0);
  return moe_ep_worker_main(argc, argv);
}
