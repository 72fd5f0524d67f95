#!/bin/bash
# One GPU measured (run from the repository root, $OUT a folder): gpu_measure (products, attention, memory-bound, host, FP8, eager steps), the flax steps
# under XLA (with HLO and cost analysis), torch.compile steps, and the calibrate command (torch, bf16).
set -u
export PYTHONPATH=$PWD
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit,memory.total --format=csv,noheader
python3 -c "import torch, jax; print(torch.__version__, jax.__version__, jax.devices())" 2>&1 | tail -1
el start gpu_measure
timeout 240 python3 benchmarks/gpu_measure.py --out $OUT/eager > $OUT/eager.log 2>&1; echo "rc=$?"; tail -4 $OUT/eager.log
el start jax_steps
timeout 150 python3 benchmarks/gpu_measure.py --out $OUT/jax --sections jax_steps > $OUT/jax.log 2>&1; echo "rc=$?"; tail -4 $OUT/jax.log
el start calibrate
timeout 90 python3 -m shardplan.cli calibrate --engine torch --dtype bf16 --name ${NAME:-gpu} --out $OUT/calibrated_torch_bf16.json > $OUT/calibrate.log 2>&1; echo "rc=$?"; tail -3 $OUT/calibrate.log
el start compiled_steps
timeout 100 python3 benchmarks/gpu_measure.py --out $OUT/compiled --sections compiled_steps > $OUT/compiled.log 2>&1; echo "rc=$?"; tail -4 $OUT/compiled.log
el done
