#!/bin/bash
# GPU check of astralight's real-model path on ONE GPU (no network needed): vLLM throughput, real
# M2PO steps (FSDP2, bf16-mixed) with the production WeightPublisher, bf16 delta sparsity and
# compression, and the RaaS weight refresh into the vLLM engine (pause time), for random-initialised
# Qwen3-0.6B and Qwen3-1.7B-shaped models. Prints ONE JSON line on stdout (progress on stderr);
# exit status 0 when every model completed. Budget: 450 s of work (under 8 minutes on one H200).
#
#   tests/gpu/check.sh                                   # both models
#   tests/gpu/check.sh --models qwen3-1.7b --enforce-eager
#   tests/gpu/check.sh --device cpu --tiny               # the same pipeline on CPU (seconds)
#
# Every option is tests/gpu/check.py's (--help). Run from anywhere; it runs in the repository root.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false
unset ASTRALIGHT_TOKEN                                 # a private loopback dataflow: no token
has_device=0
for arg in "$@"; do [[ "$arg" == "--device" || "$arg" == --device=* ]] && has_device=1; done
if [[ $has_device == 0 ]]; then
  set -- --device cuda "$@"
fi
# an outer guard only: check.py keeps its own --budget-s and prints its JSON when stopped
exec timeout --signal=TERM --kill-after=30 "${CHECK_TIMEOUT_S:-470}" python tests/gpu/check.py "$@"
