"""Building kvexport's native code and reading what a build made: where it lives (paths), the
compiler (toolchain), the build itself (build; `python -m kvexport.native`), the self-test of a
fresh op library (selftest), its ELF checks (elf) and the CPU/GPU instruction sets it needs (isa).

Run-time code (ops, host, serving) may read paths, elf and isa; only build-time code imports build,
toolchain and selftest."""
