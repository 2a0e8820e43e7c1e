"""What kvexport reads of an ELF shared object without loading it: that its tables lie within its
bytes, and which libraries it names as NEEDED.

Both are read before a loader maps the file: a truncated object dies of SIGBUS inside the loader,
and one that carries its own copy of the C++ runtime crashes the host at its first C++ exception
(docs/design.md, *The C++ runtime*). Files are read through seek/read, so a package member of a
gigabyte costs a few small reads.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

from kvexport.artifact import CONTRACT, contract_failure
from kvexport.errors import UserError

ELF_HEADER = 64
PT_LOAD = 1
PT_DYNAMIC = 2
DT_NULL, DT_NEEDED, DT_STRTAB = 0, 1, 5
SHT_SYMTAB, SHT_DYNSYM = 2, 11
_SYMBOL = 24  # sizeof(Elf64_Sym)
# The C++ runtime torch and its extensions share, and the functions every C++ object that throws or
# unwinds calls (where they are defined is where its runtime is): kvexport/contract.json states the
# rule, which the C++ harness follows too.
CXX_RUNTIME: str = CONTRACT["cxx_runtime"]["library"]
CXX_RUNTIME_ENTRY_POINTS = tuple(name.encode() for name in CONTRACT["cxx_runtime"]["entry_points"])
_LONGEST_ENTRY = max(len(n) for n in CXX_RUNTIME_ENTRY_POINTS)
_MAX_NAME = 4096


def check_elf(data: BinaryIO, size: int, name: str) -> None:
    """A 64-bit little-endian ELF file's header, program headers and section table against its size
    (the contract's elf_* failures, which the C++ harness raises alike)."""
    header = data.read(ELF_HEADER)
    if len(header) < ELF_HEADER or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
        raise contract_failure("elf_not_shared_object", name=name)
    phoff, shoff = struct.unpack_from("<QQ", header, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", header, 0x36)
    if phoff < ELF_HEADER or phoff + phentsize * phnum > size or shoff + shentsize * shnum > size:
        raise contract_failure("elf_tables_past_end", name=name, size=size)
    if phnum and phentsize < 40:  # too short for p_type .. p_filesz
        raise contract_failure("elf_short_program_headers", name=name, entry_size=phentsize)
    data.read(phoff - ELF_HEADER)
    table = data.read(phentsize * phnum)
    for i in range(phnum):
        kind, _, offset, _, _, file_size = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if kind == PT_LOAD and offset + file_size > size:
            raise contract_failure("elf_segment_past_end", name=name, end=offset + file_size, size=size)


def _table(data: BinaryIO, offset_at: int, sizes_at: int, entry: str) -> list[tuple]:
    """The program headers (offset_at 0x20) or section headers (0x28) of an ELF file, each unpacked
    by `entry`; the header gives the table's offset at offset_at and its entry size and count at sizes_at."""
    data.seek(0)
    header = data.read(ELF_HEADER)
    (offset,) = struct.unpack_from("<Q", header, offset_at)
    entry_size, count = struct.unpack_from("<HH", header, sizes_at)
    data.seek(offset)
    table = data.read(entry_size * count)
    return [struct.unpack_from(entry, table, i * entry_size) for i in range(count)]


def needed_libraries(data: BinaryIO, name: str) -> list[str]:
    """The DT_NEEDED names of a seekable ELF file whose tables check_elf accepted, in order."""
    segments = _table(data, 0x20, 0x36, "<IIQQQQ")
    dynamic = [(offset, file_size) for kind, _, offset, _, _, file_size in segments if kind == PT_DYNAMIC]
    if not dynamic:
        return []
    data.seek(dynamic[0][0])
    entries = data.read(dynamic[0][1])
    needed, strtab = [], None
    for at in range(0, len(entries) - 15, 16):
        tag, value = struct.unpack_from("<qQ", entries, at)
        if tag == DT_NULL:
            break
        if tag == DT_NEEDED:
            needed.append(value)
        elif tag == DT_STRTAB:
            strtab = value
    if not needed:
        return []
    # DT_STRTAB is an address: the loadable segment that maps it says where it lies in the file.
    base = next(
        (
            offset + strtab - vaddr
            for kind, _, offset, vaddr, _, file_size in segments
            if kind == PT_LOAD and strtab is not None and vaddr <= strtab < vaddr + file_size
        ),
        None,
    )
    if base is None:
        raise UserError(f"{name} is corrupt: its dynamic string table lies outside its loadable segments")
    names = []
    for value in needed:
        data.seek(base + value)
        raw = data.read(_MAX_NAME).split(b"\0", 1)[0]
        names.append(raw.decode("utf-8", "replace"))
    return names


def _runtime_symbols(data: BinaryIO) -> tuple[bool, bool]:
    """Whether the symbol tables (dynamic and full) define, and whether they reference undefined,
    any of the C++ runtime's entry points."""
    sections = _table(data, 0x28, 0x3A, "<IIQQQQII")
    defines = references = False
    for _, kind, _, _, offset, size, link, _ in sections:
        if kind not in (SHT_SYMTAB, SHT_DYNSYM) or link >= len(sections):
            continue
        data.seek(sections[link][4])
        strings = data.read(sections[link][5])
        data.seek(offset)
        symbols = data.read(size)
        for at in range(0, len(symbols) - _SYMBOL + 1, _SYMBOL):
            name_at, _, _, section = struct.unpack_from("<IBBH", symbols, at)
            if strings[name_at : name_at + _LONGEST_ENTRY + 1].split(b"\0", 1)[0] in CXX_RUNTIME_ENTRY_POINTS:
                defines |= section != 0
                references |= section == 0
    return defines, references


def carries_own_cxx_runtime(data: BinaryIO, name: str) -> bool:
    """Whether a C++ shared object has its own copy of the C++ runtime rather than the shared one.

    Shared: it names libstdc++.so.6 as NEEDED, or (linked with --as-needed beside a library that
    also exports the runtime's symbols) leaves the runtime's entry points undefined for the loader.
    Own: it defines them itself, or neither names nor references them (a stripped static copy).
    """
    if CXX_RUNTIME in needed_libraries(data, name):
        return False
    defines, references = _runtime_symbols(data)
    return defines or not references


def check_shared_object(data: BinaryIO, size: int, name: str) -> None:
    """check_elf, then that the object loads the shared C++ runtime; UserError naming it otherwise."""
    check_elf(data, size, name)
    if carries_own_cxx_runtime(data, name):
        raise contract_failure("own_cxx_runtime", name=name, library=CXX_RUNTIME)


def check_shared_object_file(path) -> None:
    """check_shared_object of a file on disk."""
    with open(path, "rb") as data:
        check_shared_object(data, os.fstat(data.fileno()).st_size, str(path))
