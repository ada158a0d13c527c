#include "core/thread_stack_floor.h"

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cerrno>

namespace moe_ep::core {

size_t EffectiveThreadStackBytes(size_t requested) {
  return std::max(requested, kMinThreadStackBytes);
}

}  // namespace moe_ep::core

// The executable's definition comes first in symbol lookup, so calls from
// shared libraries (civetweb) land here; the real function is the next one.
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t stacksize) {
  using SetStackSize = int (*)(pthread_attr_t*, size_t);
  static const SetStackSize real =
      reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (real == nullptr) return ENOSYS;
  return real(attr, moe_ep::core::EffectiveThreadStackBytes(stacksize));
}
