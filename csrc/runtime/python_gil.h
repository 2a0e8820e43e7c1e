// Releases Python's GIL around a blocking wait when the calling thread holds it.
//
// A host may call a package while holding the GIL (torch's AOTInductor runner does). Waiting for
// another request while holding it would stop every Python thread, including the one that has to
// finish that request. The op library does not link libpython: the C API is looked up in the
// process, and without a Python interpreter (a C++ host) this is a no-op.
#pragma once

namespace kvexport::runtime {

class ScopedGilRelease {
 public:
  ScopedGilRelease();
  ~ScopedGilRelease();
  ScopedGilRelease(const ScopedGilRelease&) = delete;
  ScopedGilRelease& operator=(const ScopedGilRelease&) = delete;

 private:
  void* saved_thread_state_ = nullptr;
};

}  // namespace kvexport::runtime
