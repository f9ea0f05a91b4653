# Finds LibTorch from the installed torch wheel (python3 -c 'import torch') unless
# CMAKE_PREFIX_PATH already points at a LibTorch. Defines the target oryx::torch.
include_guard(GLOBAL)

if(NOT Torch_DIR)
  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE _oryx_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _oryx_torch_rc ERROR_QUIET)
    if(_oryx_torch_rc EQUAL 0)
      list(APPEND CMAKE_PREFIX_PATH ${_oryx_torch_prefix})
    endif()
  endif()
endif()

# Torch's own CUDA configuration wants a toolkit; without ORYX_CUDA we still link the
# CPU part of the wheel, which is all the CPU machines can run.
# Torch's config otherwise probes the GPU by compiling and running a test program (fails where there is
# none). Name the architecture instead; our own CUDA targets use CMAKE_CUDA_ARCHITECTURES.
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "9.0a")
endif()
find_package(Torch REQUIRED)
add_library(oryx_torch INTERFACE)
target_link_libraries(oryx_torch INTERFACE ${TORCH_LIBRARIES})
# The torch wheel's libtorch.so and libtorch_cpu.so export their own copy of std::filesystem, which would
# win symbol lookup over libstdc++'s and crashes (remove_all on a non-empty directory). Listing libstdc++
# first among the needed libraries puts the system copy first in the lookup order.
target_link_options(oryx_torch INTERFACE "LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
target_compile_options(oryx_torch INTERFACE $<$<COMPILE_LANGUAGE:CXX>:${TORCH_CXX_FLAGS}>)
add_library(oryx::torch ALIAS oryx_torch)
message(STATUS "Oryx: LibTorch ${Torch_VERSION} from ${Torch_DIR}")
