# Small helpers that keep each folder's CMakeLists to a few lines.
#
#   oryx_library(NAME SRCS a.cc b.cc DEPS lib1 lib2 [CUDA])
#   oryx_test(NAME SRCS t.cc DEPS lib1 [GPU] [LABELS l] [TIMEOUT s])
#     GPU: labelled `gpu`; its main exits 77 (ctest: skipped) when no CUDA device is visible.
#   oryx_executable(NAME SRCS m.cc DEPS lib1)

include_guard(GLOBAL)

function(oryx_library name)
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SRCS})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS} oryx_warnings)
endfunction()

function(oryx_executable name)
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SRCS})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} oryx_warnings)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
endfunction()

# A GoogleTest binary registered with ctest. Tests run from the build dir, with
# ORYX_SOURCE_DIR pointing at the source tree for fixtures.
function(oryx_test name)
  cmake_parse_arguments(ARG "GPU" "TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  if(ARG_GPU)
    add_executable(${name} ${ARG_SRCS} ${PROJECT_SOURCE_DIR}/tests/gpu_test_main.cc)
    target_link_libraries(${name} PRIVATE oryx_kernels_cuda)
    list(APPEND ARG_LABELS gpu)
  else()
    add_executable(${name} ${ARG_SRCS})
    target_link_libraries(${name} PRIVATE GTest::gtest_main)
  endif()
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest oryx_warnings)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
  add_test(NAME ${name} COMMAND ${name})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 600)
  endif()
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT}
    ENVIRONMENT "ORYX_SOURCE_DIR=${PROJECT_SOURCE_DIR};ORYX_BINARY_DIR=${PROJECT_BINARY_DIR}")
  if(ARG_LABELS)
    set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABELS}")
  endif()
  # A test exiting with 77 means "skipped" (e.g. a gpu test on a machine without a GPU).
  set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77)
endfunction()

# A libFuzzer target, built only with clang and ORYX_FUZZ=ON.
function(oryx_fuzzer name)
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS" ${ARGN})
  if(NOT ORYX_FUZZ)
    return()
  endif()
  add_executable(${name} ${ARG_SRCS})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  target_compile_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/fuzz)
endfunction()

# Compiles every static library of ours that `target` links, directly or not, as position-independent code,
# so that a shared library (the Python module) can link them. The executables link the same objects: each
# source is still compiled once. -fno-semantic-interposition keeps GCC inlining and specialising the
# libraries' own functions as it does under the executables' default -fPIE (nothing interposes them).
function(oryx_position_independent target)
  get_target_property(_deps ${target} LINK_LIBRARIES)
  foreach(_dep IN LISTS _deps)
    if(NOT TARGET ${_dep})
      continue()
    endif()
    get_target_property(_type ${_dep} TYPE)
    get_target_property(_imported ${_dep} IMPORTED)
    get_target_property(_done ${_dep} POSITION_INDEPENDENT_CODE)
    if(_imported OR _done OR NOT _type STREQUAL "STATIC_LIBRARY")
      continue()
    endif()
    set_target_properties(${_dep} PROPERTIES POSITION_INDEPENDENT_CODE ON)
    if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
      target_compile_options(${_dep} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fno-semantic-interposition>)
    endif()
    oryx_position_independent(${_dep})
  endforeach()
endfunction()
