# GPU tests of the query absorption and V up-projection (label gpu: exit 77
# without a device).  The guard-page harness tests/gpu/guard_alloc.c is a
# library so other GPU tests can use it.
if(MLART_WITH_CUDA)
  add_library(mlart_guard_alloc STATIC ${CMAKE_CURRENT_SOURCE_DIR}/gpu/guard_alloc.c)
  target_link_libraries(mlart_guard_alloc PUBLIC CUDA::cudart)
  target_include_directories(mlart_guard_alloc PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/gpu
                                                      ${CUDAToolkit_INCLUDE_DIRS})

  # Kernels that probe programmatic dependent launch (tests/gpu/pdl_probe.h).
  add_library(mlart_pdl_probe STATIC ${CMAKE_CURRENT_SOURCE_DIR}/gpu/pdl_probe.cu)
  target_link_libraries(mlart_pdl_probe PUBLIC CUDA::cudart)
  target_include_directories(mlart_pdl_probe PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/gpu)
  target_include_directories(mlart_pdl_probe PRIVATE ${PROJECT_SOURCE_DIR})

  mlart_test(ops_bmm_gpu LABELS gpu TIMEOUT 900 SOURCES gpu/ops_bmm_test.c LIBS mlart_pdl_probe)
  mlart_test(ops_guard_gpu LABELS gpu TIMEOUT 1800 SOURCES gpu/ops_guard_test.c LIBS mlart_guard_alloc)
  mlart_test(ops_guard_cublas LABELS gpu TIMEOUT 600 SOURCES gpu/ops_guard_cublas.c
             LIBS mlart_guard_alloc CUDA::cublas)
endif()
