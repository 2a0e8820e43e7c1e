"""Where kvexport's native code lives: its sources (a source checkout), its build directories, the op
library a host loads and the replay harness. Build and run-time code both read these; nothing here
builds anything."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent
SOURCE_DIR = PACKAGE_DIR.parent / "csrc"
BUILD_DIR = PACKAGE_DIR.parent / "build" / "csrc"
OPS_LIBRARY_NAME = "libkvexport_ops.so"
OPS_LIBRARY = PACKAGE_DIR / "_lib" / OPS_LIBRARY_NAME
REPLAY_BINARY = BUILD_DIR / "replay" / "kvexport_replay"
NATIVE_ISA = "native"
# Portable baselines a build may ask for (the x86-64 psABI levels GCC and Clang accept in -march).
PORTABLE_ISAS = ("x86-64-v2", "x86-64-v3", "x86-64-v4")
