# Runtime core: tensors, context, config, registry/loader, layer contract
# enforcement, and the mlart-decode command line.

# Backend modules the loader tests open through MLART_BACKEND_PATH, all built
# from one small host backend (tests/plugins/testhost.c) with different
# compile definitions.  They link nothing from libmlart.
set(MLART_TEST_PLUGIN_DIR ${CMAKE_CURRENT_BINARY_DIR}/plugins)
set(MLART_TEST_PLUGINS "")
function(mlart_test_plugin name)
  set(t mlart-backend-${name})
  add_library(${t} MODULE ${CMAKE_CURRENT_SOURCE_DIR}/plugins/testhost.c)
  target_include_directories(${t} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}
                                          ${CMAKE_CURRENT_SOURCE_DIR})
  target_compile_definitions(${t} PRIVATE PLUGIN_NAME="${name}" ${ARGN})
  # Left uninstrumented in sanitizer builds, as a module built elsewhere
  # would be: a module that needs a sanitizer runtime of its own cannot be
  # loaded by a program that links one statically (tests/gpu/host-asan.sh).
  target_compile_options(${t} PRIVATE ${MLART_C_WARNINGS} -fno-sanitize=all)
  target_link_options(${t} PRIVATE -fno-sanitize=all)
  target_link_libraries(${t} PRIVATE m)
  set_target_properties(${t} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${MLART_TEST_PLUGIN_DIR})
  set(MLART_TEST_PLUGINS ${MLART_TEST_PLUGINS} ${t} PARENT_SCOPE)
endfunction()
mlart_test_plugin(testhost MAX_HEADS=8 HEAD_MULTIPLE=2 MAX_TOPK=64)
mlart_test_plugin(testsafe QUERY_SAFE_OP TOKEN_MAJOR)
mlart_test_plugin(testpad TAIL_PAD=256)
mlart_test_plugin(badabi ABI_VERSION=2)
mlart_test_plugin(smallstruct STRUCT_SIZE=64)
mlart_test_plugin(nosym NO_ENTRY)
mlart_test_plugin(nulltable NULL_TABLE)
mlart_test_plugin(noattend NO_ATTEND)
mlart_test_plugin(wrongname TABLE_NAME="othername")
mlart_test_plugin(untermname UNTERMINATED_NAME)
mlart_test_plugin(reentrant LOOKUP_IN_ENTRY)
mlart_test_plugin(silentplan SILENT_PLAN_FAIL)

if(MLART_WITH_CUDA)
  # a CUDA module with a CONTIGUOUS query contract, for the device-side materialisation
  add_library(mlart-backend-testcuda MODULE ${CMAKE_CURRENT_SOURCE_DIR}/plugins/testcuda.c)
  target_include_directories(mlart-backend-testcuda PRIVATE ${PROJECT_SOURCE_DIR}/include
                             ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  target_compile_options(mlart-backend-testcuda PRIVATE ${MLART_C_WARNINGS} -fno-sanitize=all)
  target_link_options(mlart-backend-testcuda PRIVATE -fno-sanitize=all)
  target_link_libraries(mlart-backend-testcuda PRIVATE CUDA::cudart)
  set_target_properties(mlart-backend-testcuda PROPERTIES
                        LIBRARY_OUTPUT_DIRECTORY ${MLART_TEST_PLUGIN_DIR})
  list(APPEND MLART_TEST_PLUGINS mlart-backend-testcuda)
endif()

set(_runtime_defs MLART_TEST_PLUGIN_DIR="${MLART_TEST_PLUGIN_DIR}"
                  MLART_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
foreach(n tensor config registry layer dcp rendezvous graphs)
  if(NOT EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/runtime/test_${n}.c)
    continue()
  endif()
  mlart_test(test_runtime_${n} LABELS cpu SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/runtime/test_${n}.c
             LIBS mlart_rendezvous ${CMAKE_DL_LIBS})
  target_compile_definitions(test_runtime_${n} PRIVATE ${_runtime_defs})
  add_dependencies(test_runtime_${n} ${MLART_TEST_PLUGINS})
endforeach()

if(MLART_WITH_CUDA)
  mlart_test(test_runtime_layer_gpu LABELS gpu
             SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/runtime/test_layer_gpu.c
             LIBS ${CMAKE_DL_LIBS} mlart_pdl_probe)
  target_compile_definitions(test_runtime_layer_gpu PRIVATE ${_runtime_defs})
  add_dependencies(test_runtime_layer_gpu ${MLART_TEST_PLUGINS})
endif()

# mlart-decode end to end: default config, verification against the
# double-precision oracle, backend swapped by config / environment / flag,
# and clear failures on bad input.
if(TARGET mlart-decode)
  set(_dec $<TARGET_FILE:mlart-decode>)
  set(_tiny ${PROJECT_SOURCE_DIR}/configs/tiny-cpu.ini)
  add_test(NAME decode_tiny_verify
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 3 --verify)
  add_test(NAME decode_default_config COMMAND ${_dec} --steps 2)
  set_tests_properties(decode_default_config PROPERTIES WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  # --graph / --no-graph (CUDA only) change nothing on the host: the README's checksum, and the timing line
  # says which steps it covers
  add_test(NAME decode_graph_flag_host COMMAND ${_dec} --graph)
  add_test(NAME decode_no_graph_flag_host COMMAND ${_dec} --no-graph)
  set_tests_properties(decode_graph_flag_host decode_no_graph_flag_host PROPERTIES
                       WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
                       PASS_REGULAR_EXPRESSION "over steps 2\\.\\.16; step 1 took.*checksum 0xd80b2f10fca7e9fd")
  # the synthetic data of a larger run is drawn in pieces on several threads: the bytes (so the
  # checksum) are those of the one serial loop that drew them before
  add_test(NAME decode_fill_pieces
           COMMAND ${_dec} --config ${PROJECT_SOURCE_DIR}/configs/glm5-tp4-dcp4.ini --device cpu
                   --set heads=256 --set topk=64 --batch 5 --context 3000 --set layers=2 --steps 3)
  set_tests_properties(decode_fill_pieces PROPERTIES PASS_REGULAR_EXPRESSION "checksum 0x39bd7d15c95602c6")
  add_test(NAME decode_fp8_verify
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 2 --verify)
  set_tests_properties(decode_fp8_verify PROPERTIES ENVIRONMENT "MLART_KV_FORMAT=fp8_ds_mla"
                       PASS_REGULAR_EXPRESSION "fp8_ds_mla.*verify.*PASS")
  # decode-context parallel: the group's ranks as threads, each with its shard
  # of the cache, every rank checked against the float64 oracle over the
  # whole cache; under a launcher's rank variables a group needs NCCL
  add_test(NAME decode_dcp_local_a2a
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 3 --verify --dcp-local
                   --set heads=8 --set tp_size=2 --set dcp_size=2 --set dcp_routing=a2a
                   --set dcp_interleave=3)
  set_tests_properties(decode_dcp_local_a2a PROPERTIES
                       PASS_REGULAR_EXPRESSION "rank 1: result.*verify=PASS"
                       FAIL_REGULAR_EXPRESSION "FAIL")
  add_test(NAME decode_dcp_local_ag_rs_fp8
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 2 --verify --dcp-local
                   --set heads=8 --set tp_size=4 --set dcp_size=4 --set dcp_routing=ag_rs)
  set_tests_properties(decode_dcp_local_ag_rs_fp8 PROPERTIES ENVIRONMENT "MLART_KV_FORMAT=fp8_ds_mla"
                       PASS_REGULAR_EXPRESSION "rank 3: result.*fp8_ds_mla verify=PASS"
                       FAIL_REGULAR_EXPRESSION "FAIL")
  # a mlart-decode run of the tiny config on the CPU under ENV (";"-separated
  # assignments) whose output must match PASS
  function(mlart_decode_case name env pass)
    add_test(NAME ${name} COMMAND ${_dec} --config ${_tiny} --device cpu ${ARGN})
    set_tests_properties(${name} PROPERTIES ENVIRONMENT "${env}" PASS_REGULAR_EXPRESSION "${pass}")
  endfunction()
  mlart_decode_case(decode_dcp_ranks_need_nccl "MLART_RANK=1;MLART_WORLD_SIZE=2"
                    "rank 1: a DCP group across processes needs CUDA"
                    --steps 1 --set heads=8 --set tp_size=2 --set dcp_size=2)
  mlart_decode_case(decode_ranks_match_tp "OMPI_COMM_WORLD_RANK=0;OMPI_COMM_WORLD_SIZE=4"
                    "4 ranks \\(OMPI\\) for tp_size 2" --steps 1 --set heads=8 --set tp_size=2)
  # MLART_MASTER_PORT: group g's rendezvous is at PORT + g, so one group may take 65535 (rank 1
  # gets past the port to the missing NCCL), two may not, and without DCP no port is used
  mlart_decode_case(decode_master_port_last "MLART_RANK=1;MLART_WORLD_SIZE=2;MLART_MASTER_PORT=65535"
                    "rank 1: a DCP group across processes needs CUDA"
                    --steps 1 --set heads=8 --set tp_size=2 --set dcp_size=2)
  mlart_decode_case(decode_master_port_past_last
                    "MLART_RANK=1;MLART_WORLD_SIZE=4;MLART_MASTER_PORT=65535"
                    "MLART_MASTER_PORT '65535' is not a port of 1..65534"
                    --steps 1 --set heads=8 --set tp_size=4 --set dcp_size=2)
  mlart_decode_case(decode_master_port_no_dcp "MLART_RANK=1;MLART_WORLD_SIZE=2;MLART_MASTER_PORT=65535"
                    "rank 1: result: backend=reference"
                    --steps 1 --context 64 --set heads=8 --set tp_size=2)
  # one step: the timing line says ms/step is that step's, one-time work included
  mlart_decode_case(decode_one_step_timing "" "ms/step and tokens/s are those of the only step"
                    --steps 1 --context 64)
  # every verify line of a rank says which rank it is, the reference backend's too
  mlart_decode_case(decode_rank_verify_lines
                    "MLART_BACKEND_PATH=${MLART_TEST_PLUGIN_DIR};MLART_RANK=1;MLART_WORLD_SIZE=2"
                    "\nrank 1: verify vs reference backend: [^\n]*PASS"
                    --steps 2 --context 64 --set heads=8 --set tp_size=2 --backend testsafe --verify)
  add_test(NAME decode_backend_flag
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 2 --backend testsafe --verify)
  add_test(NAME decode_backend_env
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 2 --verify)
  set_tests_properties(decode_backend_flag decode_backend_env PROPERTIES
                       ENVIRONMENT "MLART_BACKEND_PATH=${MLART_TEST_PLUGIN_DIR};MLART_BACKEND=testsafe"
                       PASS_REGULAR_EXPRESSION "testsafe.*verify.*PASS")
  add_test(NAME decode_backend_config
           COMMAND ${_dec} --config ${CMAKE_CURRENT_SOURCE_DIR}/runtime/plugin.ini --verify)
  set_tests_properties(decode_backend_config PROPERTIES
                       ENVIRONMENT "MLART_BACKEND_PATH=${MLART_TEST_PLUGIN_DIR}"
                       PASS_REGULAR_EXPRESSION "testhost.*verify.*PASS")
  add_test(NAME decode_flag_beats_env
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 1 --backend nosuchbackend)
  set_tests_properties(decode_flag_beats_env PROPERTIES
                       ENVIRONMENT "MLART_BACKEND_PATH=${MLART_TEST_PLUGIN_DIR};MLART_BACKEND=testsafe"
                       WILL_FAIL TRUE)
  add_test(NAME decode_wrong_abi COMMAND ${_dec} --config ${_tiny} --device cpu --backend badabi)
  set_tests_properties(decode_wrong_abi PROPERTIES
                       ENVIRONMENT "MLART_BACKEND_PATH=${MLART_TEST_PLUGIN_DIR}"
                       PASS_REGULAR_EXPRESSION "ABI version 2, this runtime speaks version 1")
  add_test(NAME decode_config_typo COMMAND ${_dec} --config ${CMAKE_CURRENT_SOURCE_DIR}/runtime/typo.ini)
  set_tests_properties(decode_config_typo PROPERTIES
                       PASS_REGULAR_EXPRESSION "typo.ini:7: unknown key 'hedas'")
  add_test(NAME decode_default_from_build_dir COMMAND ${_dec} --steps 1)
  set_tests_properties(decode_default_from_build_dir PROPERTIES
                       WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}
                       PASS_REGULAR_EXPRESSION "tiny-cpu.ini.*result: backend=reference")
  # --weights: kv_b_proj from a .safetensors file written by a small tool
  add_executable(make_kv_b_proj ${CMAKE_CURRENT_SOURCE_DIR}/runtime/make_kv_b_proj.c)
  target_link_libraries(make_kv_b_proj PRIVATE mlart_common m)
  add_test(NAME decode_weights_file_setup
           COMMAND make_kv_b_proj ${CMAKE_CURRENT_BINARY_DIR}/tiny-kv_b_proj.safetensors)
  set_tests_properties(decode_weights_file_setup PROPERTIES FIXTURES_SETUP decode_weights)
  add_test(NAME decode_weights_file
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 2 --set layers=2 --verify
                   --weights ${CMAKE_CURRENT_BINARY_DIR}/tiny-kv_b_proj.safetensors --layer 0)
  add_test(NAME decode_weights_missing_layer
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 1
                   --weights ${CMAKE_CURRENT_BINARY_DIR}/tiny-kv_b_proj.safetensors --layer 5)
  set_tests_properties(decode_weights_file PROPERTIES FIXTURES_REQUIRED decode_weights
                       PASS_REGULAR_EXPRESSION "layers.*verify=PASS")
  set_tests_properties(decode_weights_missing_layer PROPERTIES FIXTURES_REQUIRED decode_weights
                       PASS_REGULAR_EXPRESSION "model.layers.5.self_attn.kv_b_proj.weight")
  # each rank reads its own TP rank's heads: with layer 0's heads 2..3 NaN,
  # rank 1 of tp_size 2 must be refused (rank 0 alone would not notice)
  add_test(NAME decode_weights_nan_heads_setup
           COMMAND make_kv_b_proj ${CMAKE_CURRENT_BINARY_DIR}/tiny-kv_b_proj-nan2.safetensors 2)
  set_tests_properties(decode_weights_nan_heads_setup PROPERTIES FIXTURES_SETUP decode_weights_nan)
  add_test(NAME decode_weights_rank_heads
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 1 --set tp_size=2
                   --set dcp_size=2 --dcp-local
                   --weights ${CMAKE_CURRENT_BINARY_DIR}/tiny-kv_b_proj-nan2.safetensors)
  set_tests_properties(decode_weights_rank_heads PROPERTIES FIXTURES_REQUIRED decode_weights_nan
                       PASS_REGULAR_EXPRESSION "non-finite value at \\[512, 0\\]")
  add_test(NAME decode_weights_dcp_local
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 2 --set tp_size=2
                   --set dcp_size=2 --dcp-local --verify
                   --weights ${CMAKE_CURRENT_BINARY_DIR}/tiny-kv_b_proj.safetensors)
  set_tests_properties(decode_weights_dcp_local PROPERTIES FIXTURES_REQUIRED decode_weights
                       PASS_REGULAR_EXPRESSION "rank 1: result: .*verify=PASS")
  # a checkpoint of another head count than the config's
  add_test(NAME decode_weights_heads_mismatch
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 1 --set heads=2
                   --weights ${CMAKE_CURRENT_BINARY_DIR}/tiny-kv_b_proj.safetensors)
  set_tests_properties(decode_weights_heads_mismatch PROPERTIES FIXTURES_REQUIRED decode_weights
                       PASS_REGULAR_EXPRESSION "holds 4 heads, the config has heads = 2")
  add_test(NAME decode_layer_needs_weights COMMAND ${_dec} --config ${_tiny} --layer 1)
  set_tests_properties(decode_layer_needs_weights PROPERTIES
                       PASS_REGULAR_EXPRESSION "--layer .*needs --weights")
  # slots are int32: a cache past 2^31 slots is refused before it is sized
  add_test(NAME decode_slots_past_int32
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 1 --context 1 --batch 32769
                   --set page_size=65536)
  set_tests_properties(decode_slots_past_int32 PROPERTIES
                       PASS_REGULAR_EXPRESSION "past the int32 slot numbers")
  # a lost table or result line is a failed run
  add_test(NAME decode_output_write_error
           COMMAND sh -c "\"$0\" --config \"$1\" --device cpu --steps 1 > /dev/full"
                   ${_dec} ${_tiny})
  set_tests_properties(decode_output_write_error PROPERTIES
                       PASS_REGULAR_EXPRESSION "writing the output failed")
  add_test(NAME decode_bad_flag COMMAND ${_dec} --steps zero)
  set_tests_properties(decode_bad_flag PROPERTIES WILL_FAIL TRUE)
  # exit status 2 for what was asked (an option, a config value from any origin, a launch),
  # with the status name; `[exit N]` is printed after the run by the shell
  function(mlart_decode_exit name env pass)
    add_test(NAME ${name} COMMAND sh -c "\"$0\" \"$@\"; echo \"[exit $?]\"" ${_dec} --config ${_tiny}
                                  --device cpu --steps 1 --context 64 ${ARGN})
    set_tests_properties(${name} PROPERTIES ENVIRONMENT "${env}" PASS_REGULAR_EXPRESSION "${pass}"
                         LABELS cpu TIMEOUT 120)
  endfunction()
  mlart_decode_exit(decode_exit_env_value "MLART_BATCH=0"
                    "MLART_ECONFIG: environment MLART_BATCH: bad value '0'.*\\[exit 2\\]")
  mlart_decode_exit(decode_exit_flag_value "" "MLART_ECONFIG: --batch: bad value '0'.*\\[exit 2\\]"
                    --batch 0)
  mlart_decode_exit(decode_exit_cross_key "" "MLART_ECONFIG: .*tp_size.*\\[exit 2\\]" --set tp_size=8)
  mlart_decode_exit(decode_exit_ranks "OMPI_COMM_WORLD_RANK=0;OMPI_COMM_WORLD_SIZE=4"
                    "4 ranks \\(OMPI\\) for tp_size 1.*\\[exit 2\\]")
  # --dcp-local runs the group in this process: under a launcher it is refused
  mlart_decode_exit(decode_exit_dcp_local_launched "RANK=0;WORLD_SIZE=2"
                    "--dcp-local runs a DCP group as threads of one process, but this process is rank 0 of 2.*\\[exit 2\\]"
                    --set heads=8 --set tp_size=2 --set dcp_size=2 --dcp-local)
  # one config file a run: a second --config (here the same file again) is refused, not
  # silently read in place of the first
  mlart_decode_exit(decode_exit_config_twice ""
                    "--config given twice \\('[^']*tiny-cpu.ini', then '[^']*typo.ini'\\): a run reads one config file.*\\[exit 2\\]"
                    --config ${CMAKE_CURRENT_SOURCE_DIR}/runtime/typo.ini)
  # without DCP no rendezvous reads MLART_MASTER_PORT, whatever it holds
  mlart_decode_exit(decode_exit_port_unused "MLART_RANK=1;MLART_WORLD_SIZE=2;MLART_MASTER_PORT=abc"
                    "rank 1: result: backend=reference.*\\[exit 0\\]" --set heads=8 --set tp_size=2)
  # blanks around a value, and around a --set key, are not part of it
  mlart_decode_exit(decode_blank_values "MLART_DEVICE=cpu "
                    "bf16.*result: backend=reference device=cpu kv=bf16.*\\[exit 0\\]"
                    --kv-format " bf16 " --set " batch = 2 ")
  # more requests than the 4096 rows of a cache-fill chunk: a step's new rows
  # and slots need buffers of B rows (AddressSanitizer, tests/host-sanitizers.sh,
  # saw them overrun before)
  add_test(NAME decode_batch_over_chunk
           COMMAND ${_dec} --config ${_tiny} --device cpu --batch 4200 --context 64 --set topk=32
                   --set heads=1 --steps 2 --verify)
  set_tests_properties(decode_batch_over_chunk PROPERTIES PASS_REGULAR_EXPRESSION "verify=PASS")
  # the summary table stays aligned when a value outgrows its column's usual width: P, R, V
  # and topk of five and six digits on layers of one latent column (under 0.1 s), then a batch
  # of 100000 on layers of one column each (about 1 s)
  set(_one --set heads=1 --set qk_nope_dim=1 --set rope_dim=1 --set kv_lora_rank=1
           --set v_head_dim=1 --set topk=1 --set page_size=1 --context 1 --steps 2)
  add_test(NAME decode_table_wide_dims
           COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/runtime/decode-table.sh ${_dec} --config ${_tiny}
                   --device cpu ${_one} --set qk_nope_dim=65536 --set rope_dim=12345
                   --set v_head_dim=23456 --set topk=123456)
  add_test(NAME decode_table_wide_batch
           COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/runtime/decode-table.sh ${_dec} --config ${_tiny}
                   --device cpu ${_one} --batch 100000)
  set_tests_properties(decode_table_wide_dims decode_table_wide_batch PROPERTIES
                       PASS_REGULAR_EXPRESSION "16 columns aligned" LABELS cpu TIMEOUT 120)
  # a cache the host cannot hold: the failure names the bytes asked for
  # (under AddressSanitizer the allocator must return NULL, not abort)
  add_test(NAME decode_out_of_memory
           COMMAND ${_dec} --config ${_tiny} --device cpu --batch 1 --context 1073741000
                   --set page_size=65536 --steps 1)
  set_tests_properties(decode_out_of_memory PROPERTIES
                       ENVIRONMENT "ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:allocator_may_return_null=1"
                       PASS_REGULAR_EXPRESSION
                       "allocating the KV cache failed: MLART_ENOMEM: [0-9]+ bytes \\([0-9.]+ GiB\\) of host memory are not available")
  # a step's host buffers past any memory: the failure names their sizes and the keys to lower
  add_test(NAME decode_host_buffers_out_of_memory
           COMMAND ${_dec} --config ${_tiny} --device cpu --steps 1 --context 1 --batch 1048576
                   --set heads=65536 --set qk_nope_dim=65536 --set topk=64 --set page_size=1)
  set_tests_properties(decode_host_buffers_out_of_memory PROPERTIES
                       ENVIRONMENT "ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:allocator_may_return_null=1"
                       PASS_REGULAR_EXPRESSION
                       "allocating host buffers failed: MLART_ENOMEM: .*9015995347763200 bytes.*lower batch, heads, topk or context"
                       LABELS cpu TIMEOUT 120)
  set_tests_properties(decode_tiny_verify decode_default_config decode_fp8_verify
                       decode_backend_flag decode_backend_env decode_backend_config
                       decode_flag_beats_env
                       decode_wrong_abi decode_config_typo decode_bad_flag
                       decode_default_from_build_dir decode_weights_file_setup decode_weights_file
                       decode_weights_missing_layer decode_batch_over_chunk decode_out_of_memory
                       decode_weights_nan_heads_setup decode_weights_rank_heads
                       decode_weights_dcp_local decode_weights_heads_mismatch
                       decode_layer_needs_weights decode_slots_past_int32
                       decode_output_write_error
                       decode_dcp_local_a2a
                       decode_dcp_local_ag_rs_fp8 decode_dcp_ranks_need_nccl decode_ranks_match_tp
                       decode_master_port_last decode_master_port_past_last
                       decode_master_port_no_dcp decode_one_step_timing decode_rank_verify_lines
                       PROPERTIES LABELS cpu TIMEOUT 120)
endif()

# The NCCL communicator and the DCP step over it: alone each is rank 0 of 1;
# under `mpirun -np N` each process is one rank (tests/gpu/nccl_rank.h says
# which variables they read).
if(MLART_WITH_CUDA)
  mlart_test(test_comm_nccl_gpu LABELS gpu mpi TIMEOUT 300
             SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/gpu/test_comm_nccl.c LIBS mlart_rendezvous)
  # the layer's DCP step over NCCL: alone a group of one (the plain step's bytes)
  mlart_test(test_dcp_nccl_gpu LABELS gpu mpi TIMEOUT 300
             SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/gpu/test_dcp_nccl.c LIBS mlart_rendezvous)
endif()
