#include "replay/ops.h"

#include "replay/artifact.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>

namespace kvexport::replay {

std::vector<c10::IValue> call_op(const char* name, std::vector<c10::IValue> args) {
  const auto op = c10::Dispatcher::singleton().findSchema({name, ""});
  if (!op) {
    throw ReplayError(kUnusable, std::string("the op library is of another kvexport version (it lacks ") + name +
                                     "): rebuild the artifact with this kvexport");
  }
  op->callBoxed(&args);
  return args;
}

}  // namespace kvexport::replay
