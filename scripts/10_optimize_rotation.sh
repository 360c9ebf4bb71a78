#!/usr/bin/env bash
# Learn R1/R2 (SpinQuant), as the reference's scripts/10_optimize_rotation.sh: MODEL W_BITS A_BITS KV_BITS.
#   bash scripts/10_optimize_rotation.sh smollm2-135m 16 4 4      -> out/R_smollm2-135m_W16A4KV4.bin
# The reference trains 100 steps on 800 x 2048 tokens on 8 GPUs; on a CPU keep --seq-len short.
# Extra flags pass through (e.g. --steps 20 --device cuda); under torchrun it splits each batch.
set -euo pipefail
MODEL=${1:?model} W=${2:?w_bits} A=${3:?a_bits} KV=${4:?kv_bits}; shift 4
NAME=$(basename "$MODEL" .gguf)
mkdir -p out
exec "$(dirname "$0")/../.venv/bin/spinquant-et" optimize --model "$MODEL" --w-bits "$W" --a-bits "$A" --kv-bits "$KV" \
  --steps 100 --lr 1.5 --seq-len 512 --out "out/R_${NAME}_W${W}A${A}KV${KV}.bin" --force "$@"
