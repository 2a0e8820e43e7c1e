// The shared objects inside an AOTInductor package, checked before the package is loaded.
#pragma once

#include <filesystem>

namespace kvexport::replay {

// Every .so member of the package at `package` is whole: a 64-bit little-endian ELF file whose
// program headers, section table and loadable segments lie within its bytes. torch's loader maps a
// member that ends early as it is, and the process then dies of SIGBUS with no message; this throws
// ReplayError naming the member instead, with the contract's elf_* failures (as Python). Each
// must also use the host's C++ runtime (the contract's cxx_runtime rule): one with its own copy
// crashes the host at its first C++ exception.
void check_shared_objects(const std::filesystem::path& package);

}  // namespace kvexport::replay
