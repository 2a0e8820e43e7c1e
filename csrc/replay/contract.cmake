# Embeds the artifact integrity contract (kvexport/contract.json) into the replay harness as a
# generated header (replay/contract.h), so the harness and `kvexport verify` follow one statement
# and the harness reads nothing at run time to learn it. Included by csrc/CMakeLists.txt after
# the kvexport_replay target is defined.
set(KVEXPORT_CONTRACT_FILE ${CMAKE_CURRENT_LIST_DIR}/../../kvexport/contract.json)
# A changed contract re-runs configure, which regenerates the header and rebuilds the harness.
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${KVEXPORT_CONTRACT_FILE})
file(READ ${KVEXPORT_CONTRACT_FILE} KVEXPORT_CONTRACT_JSON)
configure_file(${CMAKE_CURRENT_LIST_DIR}/contract.h.in ${CMAKE_BINARY_DIR}/generated/replay/contract.h @ONLY)
target_include_directories(kvexport_replay PRIVATE ${CMAKE_BINARY_DIR}/generated)
