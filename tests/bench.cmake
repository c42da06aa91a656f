# mlart-bench's command line: every argument is checked before the first CUDA
# call, so these run without a GPU.  A bad value is a usage error (exit 2) whose
# message names the option and the value.  A valid command line needs a device
# (without one mlart-bench exits 2, "no CUDA device"), so none is tested here.
if(TARGET mlart-bench)
  set(_bench $<TARGET_FILE:mlart-bench>)
  # mlart_bench_cli_test(<name> <regex> <args...>): run mlart-bench with args
  # and print "[exit N]" after its output, so the one regular expression checks
  # both the message and the exit status.
  function(mlart_bench_cli_test name regex)
    add_test(NAME ${name} COMMAND sh -c "\"$0\" \"$@\"; echo \"[exit $?]\"" ${_bench} ${ARGN})
    set_tests_properties(${name} PROPERTIES PASS_REGULAR_EXPRESSION "${regex}" LABELS cpu TIMEOUT 60)
  endfunction()

  mlart_bench_cli_test(bench_reps_trailing "--reps '10x': expected a whole number in 1\\.\\.100000.*\\[exit 2\\]"
                       --reps 10x)
  mlart_bench_cli_test(bench_reps_past_long "--reps '99999999999': expected.*\\[exit 2\\]" --reps 99999999999)
  mlart_bench_cli_test(bench_reps_past_int "--reps '4294967297': expected.*\\[exit 2\\]" --reps 4294967297)
  mlart_bench_cli_test(bench_reps_zero "--reps '0': expected.*\\[exit 2\\]" --reps 0)
  mlart_bench_cli_test(bench_warmup_word "--warmup 'abc': expected a whole number in 0\\.\\..*\\[exit 2\\]"
                       --warmup abc)
  mlart_bench_cli_test(bench_warmup_negative "--warmup '-1': expected.*\\[exit 2\\]" --warmup -1)
  mlart_bench_cli_test(bench_device_past_int "--device '4294967296': expected.*\\[exit 2\\]" --device 4294967296)
  mlart_bench_cli_test(bench_device_negative "--device '-1': expected.*\\[exit 2\\]" --device -1)
  mlart_bench_cli_test(bench_device_blank "--device ' 1': expected.*\\[exit 2\\]" --device " 1")
  mlart_bench_cli_test(bench_sets_trailing "--sets '5abc': expected a whole number in 1\\.\\.128.*\\[exit 2\\]"
                       --sets 5abc)
  mlart_bench_cli_test(bench_sets_past_max "--sets '129': expected.*\\[exit 2\\]" --sets 129)
  # a forgotten value: the next option is not taken for it
  mlart_bench_cli_test(bench_filter_takes_option
                       "--filter needs a value, got the option '--variants'.*\\[exit 2\\]" --filter --variants)
  mlart_bench_cli_test(bench_json_takes_option "--json needs a value, got the option '--reps'.*\\[exit 2\\]"
                       --json --reps 3)
  mlart_bench_cli_test(bench_reps_missing "--reps needs a value\n.*\\[exit 2\\]" --variants --reps)
  # --help prints the ranges the checks above enforce
  mlart_bench_cli_test(bench_help
                       "--reps N .*1\\.\\.100000, default 25.*--warmup N .*0\\.\\.100000, default 3.*--sets N .*1\\.\\.128.*\\[exit 0\\]"
                       --help)
  # help that could not be written is a failed run
  add_test(NAME bench_help_write_error COMMAND sh -c "\"$0\" --help > /dev/full; echo \"[exit $?]\"" ${_bench})
  set_tests_properties(bench_help_write_error PROPERTIES
                       PASS_REGULAR_EXPRESSION "writing the output failed.*\\[exit 1\\]" LABELS cpu TIMEOUT 60)
endif()
