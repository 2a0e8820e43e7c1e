#include "runtime/python_gil.h"

#include <dlfcn.h>

namespace kvexport::runtime {

namespace {

struct PythonApi {
  int (*is_initialized)() = nullptr;
  int (*gil_check)() = nullptr;
  void* (*save_thread)() = nullptr;
  void (*restore_thread)(void*) = nullptr;

  PythonApi() {
    is_initialized = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "Py_IsInitialized"));
    gil_check = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "PyGILState_Check"));
    save_thread = reinterpret_cast<void* (*)()>(dlsym(RTLD_DEFAULT, "PyEval_SaveThread"));
    restore_thread = reinterpret_cast<void (*)(void*)>(dlsym(RTLD_DEFAULT, "PyEval_RestoreThread"));
  }

  bool available() const { return is_initialized && gil_check && save_thread && restore_thread; }
};

const PythonApi& python_api() {
  static const PythonApi api;
  return api;
}

}  // namespace

ScopedGilRelease::ScopedGilRelease() {
  const auto& api = python_api();
  if (api.available() && api.is_initialized() && api.gil_check()) saved_thread_state_ = api.save_thread();
}

ScopedGilRelease::~ScopedGilRelease() {
  if (saved_thread_state_) python_api().restore_thread(saved_thread_state_);
}

}  // namespace kvexport::runtime
