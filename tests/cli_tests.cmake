# Tests of the `moekit` command-line tool.
#
# This file has two roles. Included from tests/CMakeLists.txt it declares the tests. Run as a script it
# is their checker, because ctest's PASS_REGULAR_EXPRESSION passes when any one pattern matches and then
# ignores the exit status:
#   cmake -DEXPECT=success|failure -P cli_tests.cmake -- [PATTERNS regex...] RUN program args...
# runs the program and passes when its exit status is as expected and its output (stdout and stderr)
# matches every pattern.
if(CMAKE_SCRIPT_MODE_FILE)
  set(patterns)
  set(command)
  set(section)
  set(after_separator FALSE)
  math(EXPR last "${CMAKE_ARGC} - 1")
  foreach(i RANGE ${last})
    set(arg "${CMAKE_ARGV${i}}")
    if(NOT after_separator)
      if(arg STREQUAL "--")
        set(after_separator TRUE)
      endif()
    elseif(section STREQUAL "RUN")
      list(APPEND command "${arg}")
    elseif(arg STREQUAL "PATTERNS" OR arg STREQUAL "RUN")
      set(section "${arg}")
    elseif(section STREQUAL "PATTERNS")
      list(APPEND patterns "${arg}")
    else()
      message(FATAL_ERROR "cli_tests.cmake: unexpected argument '${arg}' before PATTERNS or RUN")
    endif()
  endforeach()
  if(NOT command)
    message(FATAL_ERROR "cli_tests.cmake: no RUN command given")
  endif()

  execute_process(COMMAND ${command} OUTPUT_VARIABLE output ERROR_VARIABLE output RESULT_VARIABLE status)
  string(JOIN " " command_line ${command})
  message("$ ${command_line}\n${output}(exit status ${status})")
  if(EXPECT STREQUAL "success" AND NOT status EQUAL 0)
    message(FATAL_ERROR "expected success, got exit status ${status}")
  elseif(EXPECT STREQUAL "failure" AND (status EQUAL 0 OR NOT status MATCHES "^[0-9]+$"))
    # A status that is not a number means the program crashed: a failure, but not the clean one we want.
    message(FATAL_ERROR "expected a clean failure (non-zero exit status), got '${status}'")
  elseif(NOT EXPECT MATCHES "^(success|failure)$")
    message(FATAL_ERROR "cli_tests.cmake: EXPECT must be success or failure, got '${EXPECT}'")
  endif()
  foreach(pattern IN LISTS patterns)
    if(NOT output MATCHES "${pattern}")
      message(FATAL_ERROR "output does not match '${pattern}'")
    endif()
  endforeach()
  return()
endif()

# add_cli_test(NAME EXPECT success|failure [PATTERNS regex...] ARGS args...)
function(add_cli_test name)
  cmake_parse_arguments(PARSE_ARGV 1 cli "" "EXPECT" "PATTERNS;ARGS")
  add_test(NAME ${name}
           COMMAND ${CMAKE_COMMAND} -DEXPECT=${cli_EXPECT} -P ${CMAKE_CURRENT_FUNCTION_LIST_FILE} --
                   PATTERNS ${cli_PATTERNS} RUN $<TARGET_FILE:moekit_cli> ${cli_ARGS})
endfunction()

# Every built-in backend is listed, with whether it runs here ("name   yes|no").
set(backend_names eager batched_mm grouped_mm deepgemm deepgemm_megamoe sonicmoe)
set(backend_rows)
foreach(name IN LISTS backend_names)
  list(APPEND backend_rows "${name} +(yes|no) ")
endforeach()
add_cli_test(cli_backends EXPECT success PATTERNS ${backend_rows} ARGS backends)

# A misspelt backend is reported with the valid names, before the (missing) input file is read.
add_cli_test(cli_experts_unknown_backend EXPECT failure
             PATTERNS "unknown experts backend 'no_such_backend'"
                      "valid: eager, batched_mm, grouped_mm, deepgemm, deepgemm_megamoe, sonicmoe"
             ARGS experts --input does_not_exist.safetensors --backend no_such_backend --output unused.safetensors)

add_cli_test(cli_experts_help EXPECT success PATTERNS "--input" "--backend" "--device" "--output"
             ARGS experts --help)
add_cli_test(cli_experts_needs_input EXPECT failure PATTERNS "--input is required"
             ARGS experts --backend eager --output unused.safetensors)

# The round trip through `moekit experts` (write a problem, run the binary, compare with the reference)
# lives in test_safetensors.cpp (CliExperts*), which runs the binary at this path.
target_compile_definitions(moekit_tests PRIVATE MOEKIT_CLI_PATH="$<TARGET_FILE:moekit_cli>")
add_dependencies(moekit_tests moekit_cli)

# The model commands, on the fixture checkpoints (made with transformers) and on a random model.
set(fixture_models ${CMAKE_CURRENT_SOURCE_DIR}/fixtures/models)
add_cli_test(cli_generate_fixture_tokens EXPECT success
             PATTERNS "qwen3_moe: 3 layers \\(2 MoE\\)" "prefill: 3 tokens" "decode:  3 tokens"
                      "experts \"\": batched_mm" "stopped: max new tokens after 4 new tokens"
             ARGS generate --model ${fixture_models}/qwen3_moe --prompt-tokens 5,6,7 --max-new-tokens 4
                  --experts-implementation batched_mm --raw)
add_cli_test(cli_generate_no_tokenizer EXPECT failure PATTERNS "has no tokenizer.json" "--prompt-tokens"
             ARGS generate --model ${fixture_models}/mixtral --prompt hello)
add_cli_test(cli_generate_bad_token_list EXPECT failure PATTERNS "--prompt-tokens: '2x' is not a token id"
             ARGS generate --model ${fixture_models}/mixtral --prompt-tokens 1,2x,3)
add_cli_test(cli_generate_unknown_backend EXPECT failure PATTERNS "unknown experts backend 'fastest'"
             ARGS generate --model ${fixture_models}/mixtral --prompt-tokens 1 --experts-implementation fastest)
add_cli_test(cli_generate_missing_model EXPECT failure PATTERNS "no_such_dir"
             ARGS generate --model no_such_dir --prompt-tokens 1)
add_cli_test(cli_generate_max_new_tokens_overflow EXPECT failure
             PATTERNS "prompt tokens \\+ max_new_tokens - 1: 3 \\+ 9223372036854775806 does not fit in 64 bits"
             ARGS generate --model ${fixture_models}/qwen3_moe --prompt-tokens 5,6,7 --max-new-tokens 9223372036854775807)
add_cli_test(cli_generate_kv_cache_too_large EXPECT failure
             PATTERNS "the KV cache for 100000000000 positions .* needs 69.8 TiB .* on cpu but .* is available"
             ARGS generate --model ${fixture_models}/qwen3_moe --prompt-tokens 5 --max-new-tokens 100000000000)
add_cli_test(cli_forward_writes_logits EXPECT success PATTERNS "wrote logits \\[3, 96\\] float32"
             ARGS forward --model ${fixture_models}/olmoe --tokens 4,5,6
                  --output ${CMAKE_CURRENT_BINARY_DIR}/cli_forward_logits.safetensors)
add_cli_test(cli_forward_needs_tokens EXPECT failure PATTERNS "--tokens is required"
             ARGS forward --model ${fixture_models}/olmoe --output unused.safetensors)
add_cli_test(cli_make_model_unknown_preset EXPECT failure PATTERNS "unknown preset 'huge'" "presets: tiny"
             ARGS make-model --preset huge --out ${CMAKE_CURRENT_BINARY_DIR}/unused_model)
add_cli_test(cli_make_model_past_memory EXPECT failure
             PATTERNS "make-model: a random qwen3-30b-a3b model of 1000000 layers in bf16 needs [0-9.]+ TiB"
                      "on cpu but .* is available"
             ARGS make-model --preset qwen3-30b-a3b --layers 1000000 --out ${CMAKE_CURRENT_BINARY_DIR}/unused_model)
# The README's main job: the built-in model, written into the build tree rather than ~/.cache.
add_cli_test(cli_generate_builtin EXPECT success
             PATTERNS "writing the built-in model|model: .*builtin-tiny-v1" "qwen3_moe: 4 layers" "Hello, experts"
                      "prefill: 15 tokens" "decode:  7 tokens" "stopped: max new tokens after 8 new tokens"
             ARGS generate --prompt "Hello, experts!" --max-new-tokens 8 --ignore-eos)
set_tests_properties(cli_generate_builtin PROPERTIES ENVIRONMENT "XDG_CACHE_HOME=${CMAKE_CURRENT_BINARY_DIR}/cache")
# Quantised weights in the benchmark: every CPU backend times FP8 and FP4 experts on a small custom layer, and
# the printed header names the weight storage (so a row never passes for bf16).
foreach(weights fp8 fp8-ue8m0 fp4)
  add_cli_test(cli_bench_weights_${weights} EXPECT success
               PATTERNS "--weights ${weights}" "${weights} \\(fp[48]_e[24]m[31], (f32|ue8m0) scales; bf16 activations\\)"
                        "custom +1  batched_mm +[0-9.]+ " "custom +16  grouped_mm +[0-9.]+ " "custom +16  eager +[0-9.]+ "
               ARGS bench --shape custom --hidden 256 --intermediate 96 --experts 8 --top-k 2 --tokens 1,16
                    --weights ${weights} --repeats 2 --warmup 1 --memory-bandwidth-gbs 10
                    --json ${CMAKE_CURRENT_BINARY_DIR}/cli_bench_${weights}.json
                    --plot ${CMAKE_CURRENT_BINARY_DIR}/cli_bench_${weights}.svg)
endforeach()
# Forward + backward in the benchmark: every CPU backend times it; quantised weights are skipped with the reason.
add_cli_test(cli_bench_backward EXPECT success
             PATTERNS "--backward" "call GB" "custom +1  batched_mm +[0-9.]+ " "custom +16  grouped_mm +[0-9.]+ "
                      "custom +16  eager +[0-9.]+ "
             ARGS bench --shape custom --hidden 256 --intermediate 96 --experts 8 --top-k 2 --tokens 1,16 --backward
                  --repeats 2 --warmup 1 --memory-bandwidth-gbs 10
                  --json ${CMAKE_CURRENT_BINARY_DIR}/cli_bench_backward.json
                  --plot ${CMAKE_CURRENT_BINARY_DIR}/cli_bench_backward.svg)
add_cli_test(cli_bench_backward_quantised EXPECT success
             PATTERNS "custom +16  grouped_mm +skipped: quantised experts .* have no backward: FP8 / FP4 training is out of scope"
             ARGS bench --shape custom --hidden 256 --intermediate 128 --experts 8 --top-k 2 --tokens 16 --backward
                  --weights fp8 --backends grouped_mm --repeats 2 --warmup 1 --memory-bandwidth-gbs 10
                  --json ${CMAKE_CURRENT_BINARY_DIR}/cli_bench_backward_fp8.json
                  --plot ${CMAKE_CURRENT_BINARY_DIR}/cli_bench_backward_fp8.svg)
add_cli_test(cli_bench_weights_unknown EXPECT failure PATTERNS "--weights" "int4"
             ARGS bench --weights int4)
# A sweep that measured less than was asked exits non-zero, with the reason; sizes whose product leaves
# int64 are named.
add_cli_test(cli_bench_fails_when_a_shape_cannot_run EXPECT failure
             PATTERNS "custom needs .* more than the 0.001 MB available" "bench: 0 case.s. failed and 1 of 1 shape"
             ARGS bench --shape custom --hidden 64 --intermediate 32 --experts 4 --top-k 2 --tokens 1
                  --max-memory-gb 0.000001 --memory-bandwidth-gbs 10
                  --json ${CMAKE_CURRENT_BINARY_DIR}/cli_bench_refused.json)
add_cli_test(cli_bench_sizes_that_overflow EXPECT failure
             PATTERNS "experts x 2 x intermediate x hidden: 64 x 4611686018427387904 does not fit in 64 bits"
             ARGS bench --hidden 4611686018427387904 --intermediate 8 --experts 4 --top-k 1 --memory-bandwidth-gbs 10)
# bench-gemm times the Hopper kernels only: elsewhere it stops at once with the reason.
add_cli_test(cli_bench_gemm_refuses_the_cpu EXPECT failure PATTERNS "bench-gemm: .*compute capability 9.0"
             ARGS bench-gemm --device cpu)
add_cli_test(cli_bench_gemm_unknown_format EXPECT failure PATTERNS "--format" "int4"
             ARGS bench-gemm --format int4)
add_cli_test(cli_bench_gemm_rows_that_overflow EXPECT failure
             PATTERNS "bench-gemm: --groups x --rows-per-expert: 4 x [0-9]+ does not fit in 64 bits"
             ARGS bench-gemm --rows-per-expert 4611686018427387904 --groups 4)
# moekit quantize: a fixture's experts to FP4 (the qwen3_moe fixture's I = 24 runs FP4 quantised; FP8 would be
# dequantised at load), then generation from the copy names the quantised experts. The output directory is
# cleared first so that the tests run again.
add_test(NAME cli_quantize_clean COMMAND ${CMAKE_COMMAND} -E rm -rf ${CMAKE_CURRENT_BINARY_DIR}/cli_quantized_fp4)
set_tests_properties(cli_quantize_clean PROPERTIES FIXTURES_SETUP cli_quantize_clean)
add_cli_test(cli_quantize_fp4 EXPECT success PATTERNS "quantizing experts to fp4: 48/48" "wrote .*cli_quantized_fp4"
             ARGS quantize --model ${fixture_models}/qwen3_moe --out ${CMAKE_CURRENT_BINARY_DIR}/cli_quantized_fp4
                  --format fp4)
set_tests_properties(cli_quantize_fp4 PROPERTIES FIXTURES_REQUIRED cli_quantize_clean FIXTURES_SETUP cli_quantized)
add_cli_test(cli_quantize_generate EXPECT success
             PATTERNS "quantised experts: fp4_e2m1" "stopped: max new tokens after 4 new tokens"
             ARGS generate --model ${CMAKE_CURRENT_BINARY_DIR}/cli_quantized_fp4 --prompt-tokens 1,2,3
                  --max-new-tokens 4 --experts-implementation batched_mm)
set_tests_properties(cli_quantize_generate PROPERTIES FIXTURES_REQUIRED cli_quantized)
add_cli_test(cli_quantize_generate_dequantized EXPECT success
             PATTERNS "fp4_e2m1 experts dequantised at load" "stopped: max new tokens after 4 new tokens"
             ARGS generate --model ${CMAKE_CURRENT_BINARY_DIR}/cli_quantized_fp4 --prompt-tokens 1,2,3
                  --max-new-tokens 4 --dequantize)
set_tests_properties(cli_quantize_generate_dequantized PROPERTIES FIXTURES_REQUIRED cli_quantized)
add_cli_test(cli_quantize_bad_format EXPECT failure PATTERNS "unknown format 'int4'" "fp8, fp8-ue8m0, fp4"
             ARGS quantize --model ${fixture_models}/qwen3_moe --out ${CMAKE_CURRENT_BINARY_DIR}/unused_quantized
                  --format int4)
