#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with what benches/gpu/prepare.sh left in
# .device/: the stripped oxlm binary, the GPU test binaries, the compiled-kernel cache and a
# trimmed llama.cpp source tree.
#
# usage: benches/gpu/device.sh STAGE...   (in order)
#   tests           every carried test binary (CUDA op parity, tiny-model and adapter parity on
#                   the GPU)
#   bench           oxlm on synthetic models (random weights written here by synthetic_mlx.py):
#                   the 0.85B llama at 4 and 8 bits, the 7.2B at 4 bits, Qwen2.5-0.5B's shape
#                   at 4 and 8 bits; decode 128 tokens after 512- and 2048-token prompts, and
#                   those prefills
#   models          the models' 4-bit checkpoints, written side by side to /tmp/models/NAME-4
#                   (for a session's own runs after the stages)
#   batch           oxlm batched decode on the 0.85B 4-bit llama: 1, 2, 4, 8, 16, 32 and 64
#                   sequences decoding 128 tokens each after their own 512-token prompts
#   llamacpp-batch  llama-batched-bench on that model's Q4_0 GGUF at the same counts and lengths
#                   (once the build is done)
#   llamacpp-build  starts building llama.cpp with CUDA in the background (about 5 minutes;
#                   it outlives the call while the machine stays warm)
#   llamacpp        llama-bench on GGUFs of the same shapes (Q4_0, Q8_0), once the build is done
#   torch           PyTorch + transformers, bf16, the same shapes
#   membw           the device-to-device copy bandwidth (the roofline)
#   gemv            the matmul kernels alone at the benchmark shapes and larger ones
#                   (examples/cuda_gemv.rs)
#   profile         Nsight Compute's duration of every kernel of a short decode on the 0.85B
#                   4-bit llama (16-token prompt, 4 tokens), as CSV
#   kernels         Nsight Compute's throughput, occupancy and stall sections for the decode
#                   GEMVs and attention of that model after a 512-token prompt
#   mlx             mlx-lm on MLX's CUDA backend (mlx_lm_bench.py) on every model's 4-bit
#                   checkpoint: one sequence after 512- and 2048-token prompts, then 8, 32 and 64
#                   sequences. Its CUDA library comes in two parts (prepare.sh), each carried by
#                   a call of its own on a machine that stays warm: the stage keeps the part a
#                   call brings in /tmp/mlx and runs once both are there
#   wait-llamacpp   waits for the background build
#   stagger         oxlm batches of 16 and 64 sequences on the 0.85B 4-bit llama whose prompts are
#                   spread over the 256 tokens up to 512 (`bench --stagger`, as a server's
#                   requests come), so that they outgrow their caches at different steps; 256
#                   tokens each, the steps replayed in the JSON
#   trace           where a decode step's time goes, kernel by kernel (`OXLM_TRACE`, with the
#                   traced kernels prepare.sh compiles): the 0.85B 4-bit llama, 1, 8 and 64
#                   sequences after 512-token prompts
#   serve           `oxlm serve --device cuda` (benches/serve_bench.py) on the 0.85B llama's shape
#                   with SmolLM2's vocabulary and tokenizer (carried by prepare.sh; random weights,
#                   so the text is noise): 1, 8, 32 and 64 requests of 128 tokens sent together,
#                   decoded one at a time and batched; then a 3,000-word prompt arriving while a
#                   request streams, the stream's longest pause at prefill steps of 2048, 512 and
#                   128 (each server's first long prompt: any first-use cost its warm-up leaves
#                   shows here)
#   structured      constrained decoding's cost (`bench --json-schema`): that model, 1 and 32
#                   sequences decoding 128 tokens after 512-token prompts, free and with every
#                   sequence held to benches/structured_schema.json, in turn
#   adapters        LoRA adapters in batched decode (`bench --adapters 8`): the 0.85B 4-bit llama,
#                   8 and 32 sequences decoding 128 tokens after 512-token prompts, free, every
#                   one through one adapter (rank 8 on every linear layer), then spread over 8,
#                   in turn; the adapter runs' steps (replayed, host and GPU time) in the JSON
#   arrivals        that server under requests arriving at random (serve_bench.py --arrivals):
#                   4 seconds of them at 150 a second, then at 50 (RATES="150 50"), each asking for
#                   32 to 128 tokens
#   archs           the other architectures beside the 0.85B llama (benches/make_archs.py's
#                   models, written here at 4 bits by synthetic_mlx.py --arch-model into
#                   /tmp/models/archs/NAME: Qwen3.5, Phi-3, OLMo 3, LFM2, Qwen3-MoE, DeepSeek-V3,
#                   GLM-4.5 MoE, Qwen3-Next; ARCHS="NAME..." for some of them): one sequence
#                   decoding 128 tokens after a 512-token prompt, and that prefill, median of 3;
#                   each JSON line (archs.jsonl) carries the model's parameters, active
#                   parameters and active bytes (benches/archs.py --annotate), a "failed" line
#                   where oxlm gave none (archs.err). `python3 benches/archs.py --gpu
#                   out/archs.jsonl out/membw.jsonl` makes the table
# Logs and one JSON line per measurement go to $OUT (or ./out). ONLY=name (for example
# ONLY=qwen2.5-0.5b) keeps every stage to one of the models below (batch, stagger, trace, profile,
# kernels, serve and arrivals then take that model instead of the 0.85B llama).
# AB=NAME compares two builds: prepare.sh run with AB=REV (a git revision; NAME is REV with any /
# as -) also builds oxlm and cuda_gemv at REV, with their kernels, as .device/oxlm-NAME.gz and
# .device/cuda_gemv-NAME.gz (carry them too); bench, batch, stagger, trace, serve, arrivals and
# gemv then take each measurement with that build and this tree's in turn, ROUNDS times (2 unless
# set; without AB, 1), each JSON line led by "build": NAME or "tree", each other line by the same.
# A session's own one-off scripts and their outputs go in experiments/ (ignored by git; name it
# in the call's carry), never in the tree: a measurement worth re-running becomes a stage here.
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
# prepare.sh's kernels, and an A/B's second build, come gzipped, to fit the carry.
gunzip -f .device/cache/cuda/*.gz .device/oxlm-*.gz .device/cuda_gemv-*.gz 2>/dev/null
AB=${AB:-}
AB=${AB//\//-}
[ -z "$AB" ] || chmod +x ".device/oxlm-$AB" ".device/cuda_gemv-$AB"
ROUNDS=${ROUNDS:-${AB:+2}}
ROUNDS=${ROUNDS:-1}
LLAMA=/opt/llama.cpp
# The test binaries find tests/fixtures through the path they were built at.
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv \
  > "$OUT/gpu.txt"

# name hidden intermediate layers heads kv_heads vocab [arch]
MODELS=(
  "llama-0.85b 2048 5632 16 32 8 32000"
  "llama-7.2b 4096 14336 32 32 8 32000"
  "qwen2.5-0.5b 896 4864 24 14 2 151936 qwen2"
)
if [ -n "${ONLY:-}" ]; then
  for m in "${MODELS[@]}"; do [ "${m%% *}" = "$ONLY" ] && MODELS=("$m") && break; done
  [ "${MODELS[0]%% *}" = "$ONLY" ] || { echo "no model $ONLY" >&2; exit 2; }
fi
# benches/make_archs.py's models that the archs stage runs (Gemma 4's layout is not written here).
ARCHS=(${ARCHS:-llama-0.85b qwen3_5-0.85b phi3-0.85b olmo3-0.85b lfm2-0.85b qwen3_moe-0.85b
  deepseek_v3-0.85b glm4_moe-0.85b qwen3_next-0.85b})
shape_args() {
  echo "--hidden $2 --intermediate $3 --layers $4 --heads $5 --kv-heads $6 --vocab $7 ${8:+--arch $8}"
}

# write_model BITS NAME SHAPE...: a MODELS entry's checkpoint at BITS bits in
# /tmp/models/NAME-BITS, written unless it is there already.
write_model() {
  local bits=$1; shift
  local dir=/tmp/models/$1-$bits
  [ -f "$dir/config.json" ] || python3 benches/gpu/synthetic_mlx.py "$dir" $(shape_args "$@") --bits $bits >&2
}

# tag NAME: with AB, each JSON line led by "build":"NAME", each other line by "NAME: ".
tag() {
  if [ -n "$AB" ]; then sed -u "s/^{/{\"build\":\"$1\",/; t; s/^./$1: &/"; else cat; fi
}

# builds COMMAND...: COMMAND, whose words .device/oxlm and .device/cuda_gemv name this tree's
# builds; with AB, first with .device/oxlm-AB and .device/cuda_gemv-AB in their place, then as it
# is; ROUNDS times.
builds() {
  local suffix word label args
  for _ in $(seq "$ROUNDS"); do
    for suffix in ${AB:+"-$AB"} ""; do
      args=()
      for word in "$@"; do
        case $word in .device/oxlm | .device/cuda_gemv) word=$word$suffix ;; esac
        args+=("$word")
      done
      label=${suffix#-}
      "${args[@]}" | tag "${label:-tree}"
    done
  done
}

# serve_model: prints the directory of the first model's 4-bit checkpoint with SmolLM2's
# vocabulary (49,152) and tokenizer, so that a server reads and writes text, written unless it
# is there already.
serve_model() {
  set -- ${MODELS[0]}
  local dir=/tmp/models/$1-serve
  if [ ! -f .device/smollm2-tokenizer/tokenizer.json ]; then
    echo "no .device/smollm2-tokenizer: prepare.sh builds it; carry it" >&2
    return 1
  fi
  { [ -f "$dir/config.json" ] || python3 benches/gpu/synthetic_mlx.py "$dir" \
    $(shape_args "$1" "$2" "$3" "$4" "$5" "$6" 49152 "${8:-}") --bits 4 >&2; } \
    && cp .device/smollm2-tokenizer/* "$dir/" && echo "$dir"
}

# kernels_compile, which compiles every variant afresh (two minutes here), ran in prepare.sh.
run_tests() {
  for t in .device/tests/*; do
    echo "== $t"
    timeout 300 "$t" --test-threads=1 --nocapture --skip kernels_compile 2>&1
    echo "rc $?"
  done > "$OUT/tests.log" 2>&1
  grep -E "^(==|rc|test result|.* on cuda.*|.*FAILED.*|.*panicked.*)" "$OUT/tests.log"
}

run_bench() {
  for m in "${MODELS[@]}"; do
    set -- $m
    for bits in 4 8; do
      [ "$1" = llama-7.2b ] && [ $bits = 8 ] && continue
      dir=/tmp/models/$1-$bits
      write_model $bits "$@"
      for prompt in 512 2048; do
        builds .device/oxlm bench --device cuda --model "$dir" --prompt-tokens $prompt \
          --gen-tokens 128 --repeats 3 | tee -a "$OUT/bench.jsonl"
      done
    done
  done
}

run_models() {
  for m in "${MODELS[@]}"; do
    write_model 4 $m &
  done
  wait
}

run_batch() {
  set -- ${MODELS[0]}
  dir=/tmp/models/$1-4
  write_model 4 "$@"
  builds .device/oxlm bench --device cuda --model "$dir" --prompt-tokens 512 --gen-tokens 128 \
    --repeats 1 --batch 2 --batch 4 --batch 8 --batch 16 --batch 32 --batch 64 \
    | tee -a "$OUT/batch.jsonl"
}

run_stagger() {
  set -- ${MODELS[0]}
  dir=/tmp/models/$1-4
  write_model 4 "$@"
  builds .device/oxlm bench --device cuda --model "$dir" --prompt-tokens 512 --gen-tokens 256 \
    --repeats 1 --batch 16 --batch 64 --stagger | tee -a "$OUT/stagger.jsonl"
}

# The JSON's `trace` (one sequence) and each batch's: every kernel's microseconds a step.
run_trace() {
  set -- ${MODELS[0]}
  dir=/tmp/models/$1-4
  write_model 4 "$@"
  builds env OXLM_TRACE=1 .device/oxlm bench --device cuda --model "$dir" --prompt-tokens 512 \
    --gen-tokens 16 --repeats 1 --batch 8 --batch 64 | tee -a "$OUT/trace.jsonl"
}

run_serve() {
  local dir
  dir=$(serve_model) || return
  builds python3 benches/serve_bench.py --oxlm .device/oxlm --model "$dir" --requests 1,8,32,64 \
    --max-tokens 128 --serve-args="--device cuda" 2>&1 | tee -a "$OUT/serve.txt"
  # The stream must outlast the long prompt's prefill: thousands of tokens on a GPU.
  builds python3 benches/serve_bench.py --oxlm .device/oxlm --model "$dir" --long-prompt 3000 \
    --stream-tokens 3000 --prefill-steps 2048,512,128 --serve-args="--device cuda" 2>&1 \
    | tee -a "$OUT/serve.txt"
}

run_structured() {
  local dir
  dir=$(serve_model) || return
  builds .device/oxlm bench --model "$dir" --device cuda --prompt-tokens 512 --gen-tokens 128 \
    --batch 1 --batch 32 --json-schema benches/structured_schema.json --repeats 3 2>&1 \
    | tee -a "$OUT/structured.jsonl"
}

run_adapters() {
  set -- ${MODELS[0]}
  dir=/tmp/models/$1-4
  write_model 4 "$@"
  builds .device/oxlm bench --device cuda --model "$dir" --prompt-tokens 512 --gen-tokens 128 \
    --batch 8 --batch 32 --adapters 8 --repeats 2 | tee -a "$OUT/adapters.jsonl"
}

run_arrivals() {
  local dir rate
  dir=$(serve_model) || return
  for rate in ${RATES:-150 50}; do
    builds python3 benches/serve_bench.py --oxlm .device/oxlm --model "$dir" \
      --arrivals $((rate * 4)) --rate "$rate" --max-tokens 128 --serve-args="--device cuda" \
      2>> "$OUT/arrivals.err" | tee -a "$OUT/arrivals.jsonl"
  done
}

run_archs() {
  local name dir
  for name in "${ARCHS[@]}"; do
    dir=/tmp/models/archs/$name
    [ -f "$dir/config.json" ] || python3 benches/gpu/synthetic_mlx.py "$dir" --arch-model "$name" >&2 \
      || continue
    echo "== $name" >> "$OUT/archs.err"
    builds .device/oxlm bench --device cuda --model "$dir" --prompt-tokens 512 --gen-tokens 128 \
      --repeats 3 2>> "$OUT/archs.err" | python3 benches/archs.py --annotate "$dir" \
      | tee -a "$OUT/archs.jsonl"
  done
}

build_llamacpp() {
  mkdir -p $LLAMA && tar xzf .device/llama.cpp.tgz -C /opt
  # At the lowest priority: oxlm's host-side step walk shares these CPUs when a benchmark runs
  # during the build (which unniced tripled it and cut 7.2B decode by a third on 2026-12-01).
  (cd $LLAMA && setsid nohup nice -n 19 bash -c 'cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      > build.log 2>&1 && cmake --build build -j12 --target llama-bench llama-batched-bench llama-quantize >> build.log 2>&1; \
      echo $? > build.done' > /dev/null 2>&1 &)
  echo "llama.cpp build started"
}

run_llamacpp() {
  if [ ! -f $LLAMA/build.done ]; then echo "llama.cpp build not finished"; tail -3 $LLAMA/build.log; return; fi
  bin=$LLAMA/build/bin
  for m in "${MODELS[@]}"; do
    set -- $m
    f16=/tmp/gguf/$1-f16.gguf
    mkdir -p /tmp/gguf
    [ -f $f16 ] || python3 benches/gpu/synthetic_gguf.py $LLAMA $f16 $(shape_args "$@") >&2
    for q in Q4_0 Q8_0; do
      [ "$1" = llama-7.2b ] && [ $q = Q8_0 ] && continue
      g=/tmp/gguf/$1-$q.gguf
      [ -f $g ] || $bin/llama-quantize $f16 $g $q > /dev/null 2>&1
      $bin/llama-bench -m $g -p 512,2048 -n 128 -ngl 99 -r 3 -o jsonl 2>/dev/null | tee -a "$OUT/llamacpp.jsonl"
    done
  done
}

# Aggregate decode of 1 to 64 sequences (S_TG, tokens/s of all of them), each with its own
# 512-token prompt, as `batch` runs oxlm.
run_llamacpp_batch() {
  if [ ! -f $LLAMA/build.done ]; then echo "llama.cpp build not finished"; tail -3 $LLAMA/build.log; return; fi
  bin=$LLAMA/build/bin
  set -- ${MODELS[0]}
  f16=/tmp/gguf/$1-f16.gguf g=/tmp/gguf/$1-Q4_0.gguf
  mkdir -p /tmp/gguf
  [ -f $f16 ] || python3 benches/gpu/synthetic_gguf.py $LLAMA $f16 $(shape_args "$@") >&2
  [ -f $g ] || $bin/llama-quantize $f16 $g Q4_0 > /dev/null 2>&1
  $bin/llama-batched-bench -m $g -c 41984 -b 2048 -ub 512 -npp 512 -ntg 128 \
    -npl 1,2,4,8,16,32,64 -ngl 99 --output-format jsonl 2>/dev/null | grep '^{' \
    | tee -a "$OUT/llamacpp-batch.jsonl"
}

run_torch() {
  for m in "${MODELS[@]}"; do
    set -- $m
    python3 benches/gpu/torch_bench.py $(shape_args "$@") 2>/dev/null | tee -a "$OUT/torch.jsonl"
  done
}

run_profile() {
  set -- ${MODELS[0]}
  dir=/tmp/models/$1-4
  write_model 4 "$@"
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/profile.csv" \
    .device/oxlm bench --device cuda --model "$dir" --prompt-tokens 16 --gen-tokens 4 --repeats 1
  wc -l "$OUT/profile.csv"
}

run_kernels() {
  set -- ${MODELS[0]}
  dir=/tmp/models/$1-4
  write_model 4 "$@"
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  "$ncu" --clock-control none --kernel-name regex:'attention_|qkv_rope_int1_4|qgemv_int1_4|qglu_int1_4' \
    --launch-skip 40 --launch-count 10 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    .device/oxlm bench --device cuda --model "$dir" --prompt-tokens 512 --gen-tokens 8 --repeats 1 \
    > "$OUT/kernels.txt" 2>&1
  grep -E '^  [a-z_0-9]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued' "$OUT/kernels.txt" | head -80
}

run_mlx() {
  local env=/tmp/mlx/env
  mkdir -p /tmp/mlx
  cp .device/mlx/* /tmp/mlx/ 2>/dev/null
  if [ ! -f $env/.installed ]; then
    if [ ! -f /tmp/mlx/part1 ] || [ ! -f /tmp/mlx/part2 ]; then
      echo "mlx: kept $(ls /tmp/mlx | tr '\n' ' '); run this stage again with the other part"
      return
    fi
    mkdir -p $env
    cat /tmp/mlx/part1 /tmp/mlx/part2 | xz -d | tar xf - -C $env
    for w in /tmp/mlx/*.whl; do python3 -m zipfile -e "$w" $env; done
    touch $env/.installed
  fi
  # MLX's Python for these commands alone, so that no other stage runs with it.
  local python=(env PYTHONPATH=$env LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib
    python3)
  if ! "${python[@]}" -c 'import mlx.core as mx; assert mx.default_device() == mx.gpu' \
    2>> "$OUT/mlx.err"; then
    echo "mlx: MLX has no GPU here (mlx.err)"
    return
  fi
  run_models
  for m in "${MODELS[@]}"; do
    set -- $m
    timeout 300 "${python[@]}" benches/gpu/mlx_lm_bench.py /tmp/models/$1-4 2>> "$OUT/mlx.err" \
      | tee -a "$OUT/mlx.jsonl"
  done
}

run_membw() {
  python3 -c '
import torch
n = 4 << 30
a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
for _ in range(3): b.copy_(a)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(10): b.copy_(a)
e.record(); torch.cuda.synchronize()
print("{\"copy_tbps\": %.3f}" % (2 * n * 10 / (s.elapsed_time(e) / 1e3) / 1e12))' | tee -a "$OUT/membw.jsonl"
}

for stage in "$@"; do
  echo "### $stage"
  case $stage in
    tests) run_tests ;;
    bench) run_bench ;;
    models) run_models ;;
    batch) run_batch ;;
    llamacpp-build) build_llamacpp ;;
    llamacpp) run_llamacpp ;;
    llamacpp-batch) run_llamacpp_batch ;;
    torch) run_torch ;;
    membw) run_membw ;;
    mlx) run_mlx ;;
    gemv) builds .device/cuda_gemv | tee "$OUT/gemv.txt" ;;
    profile) run_profile ;;
    kernels) run_kernels ;;
    wait-llamacpp) while [ ! -f $LLAMA/build.done ]; do sleep 5; done ;;
    stagger) run_stagger ;;
    trace) run_trace ;;
    serve) run_serve ;;
    structured) run_structured ;;
    adapters) run_adapters ;;
    arrivals) run_arrivals ;;
    archs) run_archs ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
