#!/usr/bin/env bash
# Quantize and evaluate (perplexity), as the reference's scripts/2_eval_ptq.sh: MODEL W_BITS A_BITS KV_BITS [R.bin].
#   bash scripts/2_eval_ptq.sh smollm2-135m 4 4 4 out/R_smollm2-135m_W16A4KV4.bin
# Without an R.bin the rotation is a random Hadamard (QuaRot-style). GPTQ for the weights, as the reference.
set -euo pipefail
MODEL=${1:?model} W=${2:?w_bits} A=${3:?a_bits} KV=${4:?kv_bits} ROT=${5:-hadamard}
NAME=$(basename "$MODEL" .gguf)
BIN="$(dirname "$0")/../.venv/bin/spinquant-et"
OUT="out/q_${NAME}_W${W}A${A}KV${KV}"
"$BIN" quantize --model "$MODEL" --rotation "$ROT" --w-bits "$W" --a-bits "$A" --kv-bits "$KV" --w-method gptq \
  --out "$OUT" --force
"$BIN" eval --model "$OUT"
