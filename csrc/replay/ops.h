// Calls into the loaded op library through the dispatcher (the harness links no kvexport code).
#pragma once

#include <ATen/core/ivalue.h>

#include <vector>

namespace kvexport::replay {

// Calls op `name` ("kvexport::...") with `args`; returns its outputs. An op the loaded library
// lacks means a library of another kvexport version: ReplayError, exit 2.
std::vector<c10::IValue> call_op(const char* name, std::vector<c10::IValue> args);

}  // namespace kvexport::replay
