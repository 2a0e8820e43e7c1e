#include "replay/isa.h"

#include <utility>
#include <vector>

namespace kvexport::replay {

namespace {

// Feature names as kvexport/native/isa.py and csrc/ops/compiled_isa.h spell them. __builtin_cpu_supports
// takes a literal only, hence one entry per feature; it also checks that the OS saves the AVX and
// AVX-512 registers, as /proc/cpuinfo's flags do.
std::vector<std::pair<std::string, bool>> host_features() {
  __builtin_cpu_init();
  return {
      {"SSE3", __builtin_cpu_supports("sse3")},
      {"SSSE3", __builtin_cpu_supports("ssse3")},
      {"SSE4_1", __builtin_cpu_supports("sse4.1")},
      {"SSE4_2", __builtin_cpu_supports("sse4.2")},
      {"POPCNT", __builtin_cpu_supports("popcnt")},
      {"AVX", __builtin_cpu_supports("avx")},
      {"AVX2", __builtin_cpu_supports("avx2")},
      {"FMA", __builtin_cpu_supports("fma")},
      {"F16C", __builtin_cpu_supports("f16c")},
      {"BMI1", __builtin_cpu_supports("bmi")},
      {"BMI2", __builtin_cpu_supports("bmi2")},
      {"LZCNT", __builtin_cpu_supports("lzcnt")},
      {"MOVBE", __builtin_cpu_supports("movbe")},
      {"AVX512F", __builtin_cpu_supports("avx512f")},
      {"AVX512CD", __builtin_cpu_supports("avx512cd")},
      {"AVX512BW", __builtin_cpu_supports("avx512bw")},
      {"AVX512DQ", __builtin_cpu_supports("avx512dq")},
      {"AVX512VL", __builtin_cpu_supports("avx512vl")},
      {"AVX512IFMA", __builtin_cpu_supports("avx512ifma")},
      {"AVX512VBMI", __builtin_cpu_supports("avx512vbmi")},
      {"AVX512VBMI2", __builtin_cpu_supports("avx512vbmi2")},
      {"AVX512VNNI", __builtin_cpu_supports("avx512vnni")},
      {"AVX512BITALG", __builtin_cpu_supports("avx512bitalg")},
      {"AVX512VPOPCNTDQ", __builtin_cpu_supports("avx512vpopcntdq")},
      {"AVX512BF16", __builtin_cpu_supports("avx512bf16")},
      {"AVX512FP16", __builtin_cpu_supports("avx512fp16")},
      {"GFNI", __builtin_cpu_supports("gfni")},
      {"VAES", __builtin_cpu_supports("vaes")},
      {"VPCLMULQDQ", __builtin_cpu_supports("vpclmulqdq")},
  };
}

// A feature this table does not know counts as missing: the artifact asks for it, and nothing
// here can show that the CPU has it.
bool host_has(const std::string& feature) {
  static const auto features = host_features();
  for (const auto& [name, supported] : features) {
    if (name == feature) return supported;
  }
  return false;
}

}  // namespace

std::string missing_cpu_feature(const nlohmann::json& required) {
  static const std::pair<const char*, const char*> parts[] = {{"op_library", "the op library"},
                                                              {"package", "the package"}};
  if (!required.is_object()) return "";
  for (const auto& [part, label] : parts) {
    if (!required.contains(part) || !required[part].is_object()) continue;
    const auto& spec = required[part];
    for (const auto& feature : spec.value("cpu_features", nlohmann::json::array())) {
      if (!feature.is_string() || host_has(feature.get<std::string>())) continue;
      return "this host lacks " + feature.get<std::string>() + " required by " + label +
             " (compiled with -march=" + spec.value("march", std::string("?")) + ")";
    }
  }
  return "";
}

std::string wrong_gpu(const nlohmann::json& required, const std::string& device, const std::string& capability,
                      const std::string& name) {
  if (!required.is_object() || !required.contains("gpu") || !required["gpu"].is_object() || required["gpu"].empty()) {
    return "";
  }
  const auto& spec = required["gpu"];
  const auto built_on = spec.value("name", std::string("?"));
  if (capability.empty()) {
    return "this is a CUDA package (built on " + built_on + ") and this host has no CUDA device " + device;
  }
  const auto wanted = spec.value("capability", std::string("?"));
  if (capability == wanted) return "";
  return "the package's GPU code is compiled for compute capability " + wanted + " (" + built_on + "); " + device +
         " has " + capability + " (" + name + "): build the package on a GPU of this architecture";
}

}  // namespace kvexport::replay
