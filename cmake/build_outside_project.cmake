# Installs the built plugin into WORK_DIR/staging, MOVES that tree to WORK_DIR/prefix (a relocated
# install, as a package manager or `cp -r` to another machine makes one), checks that the moved
# package names no path of the build (source tree, build tree, staging prefix, the torch it was
# built with) and that the library's rpath is $ORIGIN-relative, then configures (once) and builds
# an outside project (SOURCE_DIR: examples/ with the C++ server, or tests/consumer/) against the
# moved prefix with find_package(fsdp_ema), as a user would; with RUN set, runs that program of
# the built project and fails when it fails. Incremental: a second run with nothing changed builds
# nothing (install keeps the build tree's file times, and the move keeps them).
# Inputs: BUILD_DIR (our build tree), SOURCE_DIR, WORK_DIR, Torch_DIR, GENERATOR, RUN (optional).
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR)
  get_filename_component(${var} "${${var}}" ABSOLUTE)
endforeach()
set(STAGING "${WORK_DIR}/staging")
set(PREFIX "${WORK_DIR}/prefix")
set(STAMP "${WORK_DIR}/build/configured.stamp")
file(REMOVE_RECURSE "${STAGING}")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${STAGING}"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed (${rc})")
endif()
file(REMOVE_RECURSE "${PREFIX}")
file(RENAME "${STAGING}" "${PREFIX}")

# Relocatable: no build-machine path in the package's CMake files or the library's rpath.
file(STRINGS "${BUILD_DIR}/CMakeCache.txt" _home REGEX "^CMAKE_HOME_DIRECTORY:")
string(REGEX REPLACE "^[^=]*=" "" _source_root "${_home}")
file(GLOB_RECURSE _cmake_files "${PREFIX}/*.cmake")
if(NOT _cmake_files)
  message(FATAL_ERROR "no CMake package files under ${PREFIX}")
endif()
set(_forbidden "${_source_root}" "${BUILD_DIR}" "${STAGING}")
if(Torch_DIR)
  get_filename_component(_torch_root "${Torch_DIR}/../../.." ABSOLUTE)  # site-packages/torch
  list(APPEND _forbidden "${_torch_root}")
endif()
foreach(_file IN LISTS _cmake_files)
  file(READ "${_file}" _text)
  foreach(_path IN LISTS _forbidden)
    string(FIND "${_text}" "${_path}" _at)
    if(NOT _at EQUAL -1)
      message(FATAL_ERROR "${_file} names the build machine's path ${_path}: not relocatable")
    endif()
  endforeach()
endforeach()
file(GLOB _libs "${PREFIX}/lib*/libfsdp_ema.so")
if(NOT _libs)
  message(FATAL_ERROR "no libfsdp_ema.so under ${PREFIX}/lib")
endif()
find_program(READELF readelf)
if(READELF)
  execute_process(COMMAND "${READELF}" -d ${_libs} OUTPUT_VARIABLE _dynamic RESULT_VARIABLE rc)
  string(REGEX MATCHALL "(RUNPATH|RPATH)[^\n]*\\[[^]]*\\]" _rpaths "${_dynamic}")
  foreach(_entry IN LISTS _rpaths)
    string(REGEX REPLACE ".*\\[(.*)\\]" "\\1" _value "${_entry}")
    string(REPLACE ":" ";" _value "${_value}")
    foreach(_dir IN LISTS _value)
      if(NOT _dir MATCHES "^\\$ORIGIN")
        message(FATAL_ERROR "${_libs} has the rpath entry '${_dir}': not $ORIGIN-relative")
      endif()
    endforeach()
  endforeach()
endif()

if(NOT GENERATOR)
  set(GENERATOR Ninja)
endif()
if(NOT EXISTS "${STAMP}")
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${WORK_DIR}/build"
                          -G "${GENERATOR}" -DCMAKE_BUILD_TYPE=Release
                          "-DCMAKE_PREFIX_PATH=${PREFIX}" "-DTorch_DIR=${Torch_DIR}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "configuring ${SOURCE_DIR} failed (${rc}):\n${out}")
  endif()
  file(WRITE "${STAMP}" "")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${WORK_DIR}/build"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building ${SOURCE_DIR} failed (${rc}):\n${out}")
endif()
message(STATUS "built: ${WORK_DIR}/build")
if(RUN)
  execute_process(COMMAND "${WORK_DIR}/build/${RUN}" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${RUN} failed (${rc})")
  endif()
endif()
