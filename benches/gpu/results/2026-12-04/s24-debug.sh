#!/usr/bin/env bash
# Session 24's fifth call: which outputs of the bulk-copy GEMV the failing GPU tests got wrong
# (a temporary print in cuda_ops' assert_close), and Nsight Compute on it and on main's one-row
# GEMV at 128,256 x 4,096 (4-bit) inside cuda_gemv's replayed steps.
# cuda_ops_debug and the kernels: branch gpu-bulk-gemv (0aca926), with a temporary print of the
# wrong outputs in assert_close.
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export OXLM_CACHE="$PWD/.device/cache"
gunzip -f .device/cache/cuda/*.gz
for t in int16_gemv_launches quantized_matmul_group_in_one_launch; do
  OXLM_BULK_MIN_WEIGHTS=0 timeout 100 .device/cuda_ops_debug --test-threads=1 --exact $t 2>&1 | grep -E "DEBUG|test result|panicked" | head -60
done | tee "$OUT/debug.txt"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for v in bulk off; do
  if [ $v = bulk ]; then export OXLM_BULK_MIN_WEIGHTS=0; k=qgemv_bulk1_4; else unset OXLM_BULK_MIN_WEIGHTS; k=qgemv_int1_4; fi
  timeout 150 "$ncu" --clock-control none --kernel-name regex:$k --launch-skip 20 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section SchedulerStats --section InstructionStats \
    .device/cuda_gemv 128256x4096 > "$OUT/ncu-$v.txt" 2>&1
  grep -E '^  [a-z_0-9]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|Issued Warp|No Eligible|Executed Ipc|Issue Slots' "$OUT/ncu-$v.txt" | head -40
done
