# Install rules for the package files: the CMake package (find_package(mlart)
# -> imported targets mlart::mlart, shared, and mlart::mlart_static), the
# pkg-config file, and backend modules.  Included at the end of the top-level
# CMakeLists.txt, after every target exists.  Headers and the two libraries
# themselves are installed there (export set mlartTargets).
include(CMakePackageConfigHelpers)

set(MLART_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/mlart CACHE STRING
    "Where the CMake package files go, relative to the prefix")
set(MLART_INSTALL_MODULEDIR ${CMAKE_INSTALL_LIBDIR}/mlart CACHE STRING
    "Where backend modules go (point MLART_BACKEND_PATH here)")

install(EXPORT mlartTargets NAMESPACE mlart:: DESTINATION ${MLART_INSTALL_CMAKEDIR}
        FILE mlartTargets.cmake)

# Libs.private of the .pc file, derived from what the libraries link
# (MLART_LINK_LIBS in the top-level CMakeLists.txt), so the two cannot drift:
# static archives by path, imported targets translated to flags.
set(MLART_PC_LIBS_PRIVATE "")
set(_mlart_cuda_dir_added OFF)
foreach(l ${MLART_LINK_LIBS})
  if(l STREQUAL "Threads::Threads")
    if(CMAKE_THREAD_LIBS_INIT)
      string(APPEND MLART_PC_LIBS_PRIVATE " ${CMAKE_THREAD_LIBS_INIT}")
    else()
      string(APPEND MLART_PC_LIBS_PRIVATE " -pthread")
    endif()
  elseif(l MATCHES "^CUDA::(.+)$")
    if(NOT _mlart_cuda_dir_added)
      string(APPEND MLART_PC_LIBS_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR}")
      set(_mlart_cuda_dir_added ON)
    endif()
    string(APPEND MLART_PC_LIBS_PRIVATE " -l${CMAKE_MATCH_1}")
  elseif(IS_ABSOLUTE "${l}")
    string(APPEND MLART_PC_LIBS_PRIVATE " ${l}")
  elseif(l MATCHES "^-")
    string(APPEND MLART_PC_LIBS_PRIVATE " ${l}")
  else()
    string(APPEND MLART_PC_LIBS_PRIVATE " -l${l}")
  endif()
endforeach()
string(STRIP "${MLART_PC_LIBS_PRIVATE}" MLART_PC_LIBS_PRIVATE)
set(MLART_PC_CFLAGS "")
if(MLART_WITH_CUDA)
  string(APPEND MLART_PC_CFLAGS " -DMLART_WITH_CUDA=1")
endif()

configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/mlartConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/mlartConfig.cmake
  INSTALL_DESTINATION ${MLART_INSTALL_CMAKEDIR}
  PATH_VARS CMAKE_INSTALL_INCLUDEDIR MLART_INSTALL_MODULEDIR)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/mlartConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mlartConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/mlartConfigVersion.cmake
        DESTINATION ${MLART_INSTALL_CMAKEDIR})

# The .pc file finds its prefix from its own location, so the same file works
# for `cmake --install --prefix` into any folder and for DESTDIR staging.
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(MLART_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(MLART_PC_LIBDIR "${CMAKE_INSTALL_LIBDIR}")
else()
  file(RELATIVE_PATH _mlart_pc_up "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
  string(REGEX REPLACE "/$" "" _mlart_pc_up "${_mlart_pc_up}")
  set(MLART_PC_PREFIX "\${pcfiledir}/${_mlart_pc_up}")
  set(MLART_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
endif()
if(IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(MLART_PC_INCLUDEDIR "${CMAKE_INSTALL_INCLUDEDIR}")
else()
  set(MLART_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/mlart.pc.in ${CMAKE_CURRENT_BINARY_DIR}/mlart.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mlart.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# Backend modules (libmlart-backend-<name>.so): every MODULE library target
# defined under backends/ (test-only modules elsewhere stay out).
function(mlart_collect_modules dir out)
  set(found "")
  get_property(tgts DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  foreach(t ${tgts})
    get_target_property(type ${t} TYPE)
    if(type STREQUAL "MODULE_LIBRARY")
      list(APPEND found ${t})
    endif()
  endforeach()
  get_property(subs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(s ${subs})
    mlart_collect_modules(${s} sub)
    list(APPEND found ${sub})
  endforeach()
  set(${out} ${found} PARENT_SCOPE)
endfunction()
mlart_collect_modules(${PROJECT_SOURCE_DIR}/backends MLART_MODULE_TARGETS)
if(MLART_MODULE_TARGETS)
  install(TARGETS ${MLART_MODULE_TARGETS} LIBRARY DESTINATION ${MLART_INSTALL_MODULEDIR})
endif()
