# One list of CUDA architectures for everything the build compiles: FSDP_EMA_CUDA_ARCHITECTURES
# (CMake syntax). torch's CMake config derives its own nvcc -gencode list from TORCH_CUDA_ARCH_LIST
# (or the environment variable, or the GPUs it detects) and appends it to CMAKE_CUDA_FLAGS, which
# every CUDA target then compiles for on top of CUDA_ARCHITECTURES. The two helpers below make
# TORCH_CUDA_ARCH_LIST follow our list before find_package(Torch), and remove the -gencode flags
# torch appended after it, so CUDA_ARCHITECTURES alone decides.

# "80-real;90" -> "8.0;9.0+PTX": N-real is a cubin only, N a cubin plus PTX, N-virtual PTX (which
# torch's list cannot say alone: it gets the cubin too). native/all/all-major map to torch's words.
function(fsdp_ema_torch_arch_list out archs)
  set(result "")
  foreach(arch IN LISTS archs)
    if(arch STREQUAL "native")
      list(APPEND result "Auto")
    elseif(arch MATCHES "^all")
      list(APPEND result "All")
    elseif(arch MATCHES "^([0-9]+)([0-9])([a-z]?)(-real|-virtual)?$")
      set(entry "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
      if(NOT CMAKE_MATCH_4 STREQUAL "-real")
        string(APPEND entry "+PTX")
      endif()
      list(APPEND result "${entry}")
    else()
      message(FATAL_ERROR "fsdp_ema: cannot read CUDA architecture '${arch}' in "
                          "FSDP_EMA_CUDA_ARCHITECTURES (expected e.g. 90, 90-real, 90a)")
    endif()
  endforeach()
  set(${out} "${result}" PARENT_SCOPE)
endfunction()

# Call before find_package(Torch): remembers the user's CMAKE_CUDA_FLAGS and sets
# TORCH_CUDA_ARCH_LIST (the variable wins over the environment in torch's config).
macro(fsdp_ema_cuda_arch_before_torch)
  fsdp_ema_torch_arch_list(_fsdp_ema_torch_archs "${FSDP_EMA_CUDA_ARCHITECTURES}")
  if(DEFINED TORCH_CUDA_ARCH_LIST AND NOT TORCH_CUDA_ARCH_LIST STREQUAL _fsdp_ema_torch_archs)
    message(STATUS "fsdp_ema: TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} replaced by "
                   "${_fsdp_ema_torch_archs} (from FSDP_EMA_CUDA_ARCHITECTURES)")
  elseif(DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    message(STATUS "fsdp_ema: environment TORCH_CUDA_ARCH_LIST=$ENV{TORCH_CUDA_ARCH_LIST} "
                   "ignored; using ${_fsdp_ema_torch_archs} (from FSDP_EMA_CUDA_ARCHITECTURES)")
  endif()
  set(TORCH_CUDA_ARCH_LIST "${_fsdp_ema_torch_archs}")
  set(_fsdp_ema_user_cuda_flags "${CMAKE_CUDA_FLAGS}")
endmacro()

# Call after find_package(Torch): drops the -gencode / --generate-code flags torch appended to
# CMAKE_CUDA_FLAGS (the user's own flags, set before, are kept as they were).
macro(fsdp_ema_cuda_arch_after_torch)
  string(LENGTH "${_fsdp_ema_user_cuda_flags}" _fsdp_ema_len)
  string(SUBSTRING "${CMAKE_CUDA_FLAGS}" 0 ${_fsdp_ema_len} _fsdp_ema_prefix)
  if(_fsdp_ema_len GREATER 0 AND _fsdp_ema_prefix STREQUAL _fsdp_ema_user_cuda_flags)
    string(SUBSTRING "${CMAKE_CUDA_FLAGS}" ${_fsdp_ema_len} -1 _fsdp_ema_torch_flags)
  else()  # CUDA was first enabled inside torch's config: every flag came through it
    set(_fsdp_ema_user_cuda_flags "")
    set(_fsdp_ema_torch_flags "${CMAKE_CUDA_FLAGS}")
  endif()
  string(REGEX REPLACE "(-gencode|--generate-code)[ =]+[^ ]+" "" _fsdp_ema_torch_flags
         "${_fsdp_ema_torch_flags}")
  string(REGEX REPLACE "-arch[ =]+[^ ]+" "" _fsdp_ema_torch_flags "${_fsdp_ema_torch_flags}")
  string(REGEX REPLACE "  +" " " _fsdp_ema_torch_flags "${_fsdp_ema_torch_flags}")
  set(CMAKE_CUDA_FLAGS "${_fsdp_ema_user_cuda_flags}${_fsdp_ema_torch_flags}")
  message(STATUS "fsdp_ema: CUDA flags after torch's config (its -gencode list removed):"
                 "${CMAKE_CUDA_FLAGS}")
endmacro()
