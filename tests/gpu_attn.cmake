# GPU tests of the sparse attention backend (b12x_mla_sparse against the
# plain CUDA and host references) and of the CUDA cache write (label gpu:
# exit 77 without a device).
if(MLART_WITH_CUDA)
  # The kernels' fp8 dequantisation on the device (tests/gpu/fp8_probe.h).
  add_library(mlart_fp8_probe STATIC ${CMAKE_CURRENT_SOURCE_DIR}/gpu/fp8_probe.cu)
  target_link_libraries(mlart_fp8_probe PUBLIC CUDA::cudart)
  target_include_directories(mlart_fp8_probe PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/gpu
                             PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_SOURCE_DIR}/include)
  target_compile_features(mlart_fp8_probe PRIVATE cxx_std_17)

  mlart_test(attn_backend_gpu LABELS gpu TIMEOUT 600 SOURCES gpu/attn_backend_test.c LIBS mlart_pdl_probe)
  mlart_test(attn_kv_write_gpu LABELS gpu TIMEOUT 300 SOURCES gpu/attn_kv_write_test.c LIBS mlart_fp8_probe mlart_pdl_probe
             mlart_guard_alloc)
endif()
# The work split of the sparse attention kernels: host arithmetic only.
if(MLART_WITH_CUDA)
  mlart_test(attn_split LABELS cpu SOURCES gpu/attn_split_test.c)
endif()
