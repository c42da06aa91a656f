# Embedding: safetensors weights, the serving example, the installed package.
set(_embed ${CMAKE_CURRENT_SOURCE_DIR}/embed)
set(_st_sources ${PROJECT_SOURCE_DIR}/runtime/safetensors.c ${PROJECT_SOURCE_DIR}/runtime/status.c)

mlart_test(test_embed_safetensors LABELS cpu
  SOURCES ${_embed}/test_safetensors.c ${_embed}/st_writer.c)

# The mutation test compiles the parser itself with AddressSanitizer and UBSan
# (the library is built without them), so it links no mlart library.
include(CheckCSourceCompiles)
set(CMAKE_REQUIRED_FLAGS "-fsanitize=address,undefined")
set(CMAKE_REQUIRED_LINK_OPTIONS "-fsanitize=address,undefined")
check_c_source_compiles("int main(void){return 0;}" MLART_EMBED_HAVE_ASAN)
unset(CMAKE_REQUIRED_FLAGS)
unset(CMAKE_REQUIRED_LINK_OPTIONS)
set(_st_san "")
if(MLART_EMBED_HAVE_ASAN)
  set(_st_san -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
endif()
add_executable(test_embed_st_mutate ${_embed}/st_mutate.c ${_embed}/st_writer.c ${_st_sources})
target_include_directories(test_embed_st_mutate PRIVATE
  ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR} ${_embed} ${CMAKE_CURRENT_SOURCE_DIR})
target_compile_options(test_embed_st_mutate PRIVATE ${MLART_C_WARNINGS} ${_st_san})
target_link_options(test_embed_st_mutate PRIVATE ${_st_san})
target_link_libraries(test_embed_st_mutate PRIVATE ${MLART_CHECK_LIBS})
add_test(NAME test_embed_st_mutate COMMAND test_embed_st_mutate)
set_tests_properties(test_embed_st_mutate PROPERTIES LABELS cpu TIMEOUT 300)

# libFuzzer target: only with clang.  The ctest entry runs a bounded session
# from the text seeds (new inputs go to the build folder, not the sources).
if(CMAKE_C_COMPILER_ID MATCHES "Clang")
  set(CMAKE_REQUIRED_FLAGS "-fsanitize=fuzzer")
  set(CMAKE_REQUIRED_LINK_OPTIONS "-fsanitize=fuzzer")
  check_c_source_compiles(
    "#include <stdint.h>\n#include <stddef.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n){(void)d;(void)n;return 0;}"
    MLART_EMBED_HAVE_LIBFUZZER)
  unset(CMAKE_REQUIRED_FLAGS)
  unset(CMAKE_REQUIRED_LINK_OPTIONS)
  if(MLART_EMBED_HAVE_LIBFUZZER)
    add_executable(fuzz_embed_st_header ${_embed}/st_fuzz.c ${_st_sources})
    target_include_directories(fuzz_embed_st_header PRIVATE
      ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR})
    target_compile_options(fuzz_embed_st_header PRIVATE -fsanitize=fuzzer,address,undefined
                           -fno-sanitize-recover=all)
    target_link_options(fuzz_embed_st_header PRIVATE -fsanitize=fuzzer,address,undefined)
    set(_corpus ${CMAKE_CURRENT_BINARY_DIR}/st_fuzz_corpus)
    file(MAKE_DIRECTORY ${_corpus})
    add_test(NAME fuzz_embed_st_header
             COMMAND fuzz_embed_st_header -runs=200000 -max_total_time=120 -seed=1
                     -dict=${_embed}/st_fuzz.dict ${_corpus} ${_embed}/st_fuzz_corpus)
    set_tests_properties(fuzz_embed_st_header PROPERTIES LABELS cpu TIMEOUT 300)
  endif()
endif()

# cmake --install into a temp prefix, then out-of-tree consumers of the
# installed package (the example of README.md, verbatim).
add_test(NAME test_embed_install
         COMMAND sh ${_embed}/install_consumer.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR}
                 ${CMAKE_C_COMPILER} ${CMAKE_COMMAND})
set_tests_properties(test_embed_install PROPERTIES LABELS cpu TIMEOUT 300 SKIP_RETURN_CODE 77)

# The serving example: protocol unit tests + load and shutdown tests against
# the real binary on 127.0.0.1.
if(TARGET mlart-serve-example)
  mlart_test(test_embed_serve LABELS cpu TIMEOUT 300
    SOURCES ${_embed}/test_serve.c ${_embed}/st_writer.c
            ${PROJECT_SOURCE_DIR}/apps/serve-example/serve_proto.c
    ARGS $<TARGET_FILE:mlart-serve-example>)
  target_include_directories(test_embed_serve PRIVATE ${PROJECT_SOURCE_DIR}/apps/serve-example)
  add_dependencies(test_embed_serve mlart-serve-example)
  # The same binary against servers on the GPU with the DeepSeek-V3.2 TP8
  # geometry (b12x_mla_sparse, 16 heads, top-k 2048), in both cache formats;
  # exit 77 without a device.
  foreach(_fmt fp8_ds_mla bf16)
    add_test(NAME test_embed_serve_gpu_${_fmt}
             COMMAND test_embed_serve $<TARGET_FILE:mlart-serve-example> --device cuda
                     --config ${PROJECT_SOURCE_DIR}/configs/deepseek-v32-tp8.ini
                     --kv-format ${_fmt})
    set_tests_properties(test_embed_serve_gpu_${_fmt} PROPERTIES LABELS gpu
                         SKIP_RETURN_CODE 77 TIMEOUT 300)
  endforeach()
endif()
