#!/usr/bin/env bash
# Quantize with GPTQ and lower to an ExecuTorch .pte, as the reference's scripts/32_eval_ptq_executorch.sh
# (which saves the checkpoint for export_llama): MODEL W_BITS A_BITS KV_BITS [R.bin].
#   bash scripts/32_export_executorch.sh smollm2-135m 4 8 16 out/R_smollm2-135m_W16A8KV16.bin
# Writes out/<model>_W4A8KV16.pte (+ tokenizer.json) and, for ExecuTorch's own export_llama,
# out/meta_<model>_W4A8KV16/ (consolidated.00.pth + params.json) when that path can run the model.
set -euo pipefail
MODEL=${1:?model} W=${2:?w_bits} A=${3:?a_bits} KV=${4:?kv_bits} ROT=${5:-hadamard}
NAME=$(basename "$MODEL" .gguf)
BIN="$(dirname "$0")/../.venv/bin/spinquant-et"
CKPT="out/q_${NAME}_W${W}A${A}KV${KV}"
"$BIN" quantize --model "$MODEL" --rotation "$ROT" --w-bits "$W" --a-bits "$A" --kv-bits "$KV" --w-method gptq \
  --group-size 32 --out "$CKPT" --force
"$BIN" export --model "$CKPT" --out "out/${NAME}_W${W}A${A}KV${KV}.pte" --force
"$BIN" convert "$CKPT" --out "out/meta_${NAME}_W${W}A${A}KV${KV}" --force \
  || echo "(convert skipped: see the message above; the .pte from spinquant-et export is complete)"
