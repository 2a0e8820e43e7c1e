// The host-CPU check of the replay harness: the twin of kvexport/native/isa.py's check_host.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace kvexport::replay {

// `required` is the manifest's "isa" object ({"op_library": {"march", "cpu_features": [...]},
// "package": {...}}, as kvexport.native.isa.artifact_isa() writes it). Returns "" when this CPU has every
// feature listed, else one line: "this host lacks AVX512F required by the op library (compiled
// with -march=native)". Call it before loading the op library or the package: code built for
// features the CPU lacks can fail with SIGILL as soon as it is loaded.
std::string missing_cpu_feature(const nlohmann::json& required);

// The GPU check, the twin of kvexport/native/isa.py's check_device: a CUDA package records its build
// GPU in `required["gpu"]` ({"capability": "9.0", "name": ...}); Inductor compiled its kernels for
// that architecture alone. `capability` and `name` describe the device the package will run on
// ("" when the host has no such CUDA device). Returns "" when the package can run there, else one
// line saying why. Call it before loading the package.
std::string wrong_gpu(const nlohmann::json& required, const std::string& device, const std::string& capability,
                      const std::string& name);

}  // namespace kvexport::replay
