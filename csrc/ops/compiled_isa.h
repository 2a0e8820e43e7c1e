// What CPU the attention kernel's translation unit was compiled for, and how its hot loop is
// multiversioned. Included by paged_attention.cpp only: that file alone is built with
// -march=KVEXPORT_KERNEL_ARCH (csrc/CMakeLists.txt), so its predefined macros describe what the
// op library requires of a host. kvexport/native/isa.py reads the resulting string from the .so file.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>

#ifndef KVEXPORT_KERNEL_ARCH
#define KVEXPORT_KERNEL_ARCH "unknown"
#endif

// GCC function multiversioning of the kernel's hot loops (the gather of a key block and the float
// loop over it): with a baseline below AVX-512 they are also compiled for x86-64-v4 (and v3), and
// the best clone the host supports is picked once, at load time (ifunc). Built for AVX-512 already
// (-march=native on such a host), one version is enough.
#if defined(KVEXPORT_KERNEL_MULTIVERSION) && defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX512F__)
#define KVEXPORT_KERNEL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define KVEXPORT_KERNEL_CLONE_LIST "x86-64-v4,x86-64-v3"
#define KVEXPORT_KERNEL_MULTIVERSIONED 1
#else
#define KVEXPORT_KERNEL_CLONES
#define KVEXPORT_KERNEL_CLONE_LIST ""
#define KVEXPORT_KERNEL_MULTIVERSIONED 0
#endif

namespace kvexport::ops::isa {

// Detects whether a feature macro is defined to 1 (as GCC and Clang define __AVX2__ etc.):
// KVEXPORT_IS_SET(__AVX2__) is 1 or 0, usable in constant expressions.
#define KVEXPORT_PLACEHOLDER_1 0,
#define KVEXPORT_SECOND(ignored, value, ...) value
#define KVEXPORT_IS_SET_3(probe) KVEXPORT_SECOND(probe 1, 0, 0)
#define KVEXPORT_IS_SET_2(value) KVEXPORT_IS_SET_3(KVEXPORT_PLACEHOLDER_##value)
#define KVEXPORT_IS_SET(macro) KVEXPORT_IS_SET_2(macro)

struct Feature {
  std::string_view name;  // the names kvexport/native/isa.py and csrc/replay/isa.cpp check
  bool enabled;
};

// From the oldest extension to the newest, so that a missing feature is reported at the lowest level.
inline constexpr Feature kFeatures[] = {
    {"SSE3", KVEXPORT_IS_SET(__SSE3__)},
    {"SSSE3", KVEXPORT_IS_SET(__SSSE3__)},
    {"SSE4_1", KVEXPORT_IS_SET(__SSE4_1__)},
    {"SSE4_2", KVEXPORT_IS_SET(__SSE4_2__)},
    {"POPCNT", KVEXPORT_IS_SET(__POPCNT__)},
    {"AVX", KVEXPORT_IS_SET(__AVX__)},
    {"AVX2", KVEXPORT_IS_SET(__AVX2__)},
    {"FMA", KVEXPORT_IS_SET(__FMA__)},
    {"F16C", KVEXPORT_IS_SET(__F16C__)},
    {"BMI1", KVEXPORT_IS_SET(__BMI__)},
    {"BMI2", KVEXPORT_IS_SET(__BMI2__)},
    {"LZCNT", KVEXPORT_IS_SET(__LZCNT__)},
    {"MOVBE", KVEXPORT_IS_SET(__MOVBE__)},
    {"AVX512F", KVEXPORT_IS_SET(__AVX512F__)},
    {"AVX512CD", KVEXPORT_IS_SET(__AVX512CD__)},
    {"AVX512BW", KVEXPORT_IS_SET(__AVX512BW__)},
    {"AVX512DQ", KVEXPORT_IS_SET(__AVX512DQ__)},
    {"AVX512VL", KVEXPORT_IS_SET(__AVX512VL__)},
    {"AVX512IFMA", KVEXPORT_IS_SET(__AVX512IFMA__)},
    {"AVX512VBMI", KVEXPORT_IS_SET(__AVX512VBMI__)},
    {"AVX512VBMI2", KVEXPORT_IS_SET(__AVX512VBMI2__)},
    {"AVX512VNNI", KVEXPORT_IS_SET(__AVX512VNNI__)},
    {"AVX512BITALG", KVEXPORT_IS_SET(__AVX512BITALG__)},
    {"AVX512VPOPCNTDQ", KVEXPORT_IS_SET(__AVX512VPOPCNTDQ__)},
    {"AVX512BF16", KVEXPORT_IS_SET(__AVX512BF16__)},
    {"AVX512FP16", KVEXPORT_IS_SET(__AVX512FP16__)},
    {"GFNI", KVEXPORT_IS_SET(__GFNI__)},
    {"VAES", KVEXPORT_IS_SET(__VAES__)},
    {"VPCLMULQDQ", KVEXPORT_IS_SET(__VPCLMULQDQ__)},
};

// "kvexport-ops-isa:march=ARCH;features=A,B,...;clones=..." as a NUL-terminated array, built at
// compile time. The marker prefix lets a reader find it in the .so file without loading it.
inline constexpr std::string_view kMarker = "kvexport-ops-isa:";

constexpr std::size_t description_size() {
  std::size_t n = kMarker.size() + std::string_view("march=" KVEXPORT_KERNEL_ARCH ";features=").size() +
                  std::string_view(";clones=" KVEXPORT_KERNEL_CLONE_LIST).size() + 1;
  for (const auto& f : kFeatures) n += f.enabled ? f.name.size() + 1 : 0;
  return n;
}

constexpr auto describe() {
  std::array<char, description_size()> out{};
  std::size_t at = 0;
  const auto put = [&](std::string_view text) {
    for (char c : text) out[at++] = c;
  };
  put(kMarker);
  put("march=" KVEXPORT_KERNEL_ARCH ";features=");
  bool first = true;
  for (const auto& f : kFeatures) {
    if (!f.enabled) continue;
    if (!first) put(",");
    put(f.name);
    first = false;
  }
  put(";clones=" KVEXPORT_KERNEL_CLONE_LIST);
  return out;  // the remaining bytes stay NUL
}

}  // namespace kvexport::ops::isa
