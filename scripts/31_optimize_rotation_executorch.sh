#!/usr/bin/env bash
# Learn R1/R2 for ExecuTorch's 8da4w scheme, as the reference's scripts/31_optimize_rotation_executorch.sh:
# MODEL W_BITS A_BITS KV_BITS (the reference uses 16 8 16: float weights, 8-bit activations, groups of 32, clipping).
#   bash scripts/31_optimize_rotation_executorch.sh smollm2-135m 16 8 16
set -euo pipefail
exec bash "$(dirname "$0")/10_optimize_rotation.sh" "$@" --group-size 32
