# Embedding: safetensors weights, the serving example, the installed package.
set(_embed ${CMAKE_CURRENT_SOURCE_DIR}/embed)

mlart_test(test_embed_safetensors LABELS cpu
  SOURCES ${_embed}/test_safetensors.c ${_embed}/st_writer.c)
