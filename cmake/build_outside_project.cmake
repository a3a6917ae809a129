# Installs the built plugin into WORK_DIR/prefix, then configures (once) and builds an outside
# project (SOURCE_DIR: examples/ with the C++ server, or tests/consumer/) against that prefix with
# find_package(fsdp_ema), as a user would; with RUN set, runs that program of the built project
# and fails when it fails. Incremental: a second run with nothing changed builds nothing.
# Inputs: BUILD_DIR (our build tree), SOURCE_DIR, WORK_DIR, Torch_DIR, GENERATOR, RUN (optional).
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR)
  get_filename_component(${var} "${${var}}" ABSOLUTE)
endforeach()
set(PREFIX "${WORK_DIR}/prefix")
set(STAMP "${WORK_DIR}/build/configured.stamp")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed (${rc})")
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
