#!/usr/bin/env bash
# Mixtral-8x7B (MoE: 8 experts, top-2) pretraining on 4 Atlas 800T A2 nodes (32 x 910B, 64 GB).
# Layout: what `megatron-npu plan --search` chose (first of its ranked layouts) for this model and cluster
# (--vocab-size: the Hugging Face config's vocab_size, the converted embedding's rows):
#   megatron-npu plan --search --nnodes 4 --nproc-per-node 8 <the model flags below> --bf16 --global-batch-size 256 --vocab-size 32000
#   TP 2 x PP 4 x VPP 4 x CP 4 x DP 1, EP 2, micro-batch 1, no recompute, distributed optimizer;
#   predicted memory: 50.6 (first stage) / 48.4 (middle, at most) / 46.0 (last) GB per card (GB = 1e9 bytes; 64 GB less 10% headroom fits);
#   predicted throughput: 2,386 tokens/s per NPU, MFU 53.7% (a model: megatron_npu/layout/step_time.py).
#
# Data and checkpoint (once, on shared storage):
#   megatron-npu preprocess --input corpus.jsonl --output-prefix /data/mixtral/corpus \
#       --tokenizer-type HuggingFaceTokenizer --tokenizer-model /data/hf/Mixtral-8x7B-v0.1 --append-eod --workers 32
#   megatron-npu convert to-megatron /data/hf/Mixtral-8x7B-v0.1 /data/mixtral/8x7b-mcore --tp $TP --pp $PP --ep $EP
#
# Run: bash examples/mixtral_8x7b.sh [--node-rank N] [--dry-run]   (HOSTS=ip0,ip1,... in node-rank order;
# --dry-run prints every node's environment and command and runs nothing). The launcher is
# scripts/pretrain_gpt_8x2.sh (node list, HCCL environment, rank-map check, checkpoints, logs).
#
# Every size and degree below is an environment variable (e.g. NUM_LAYERS=2 HIDDEN_SIZE=64); the CPU
# smoke test tests/examples/test_recipes.py runs this script scaled down that way for 2 iterations.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

export NNODES="${NNODES-4}"
export NPROC_PER_NODE="${NPROC_PER_NODE-8}"
export TP="${TP-2}"
export PP="${PP-4}"
export CP="${CP-4}"
export VPP="${VPP-4}"
export EP="${EP-2}"
export MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE-1}"
export RECOMPUTE="${RECOMPUTE-none}"
export NUM_LAYERS="${NUM_LAYERS-32}"
export HIDDEN_SIZE="${HIDDEN_SIZE-4096}"
export NUM_ATTENTION_HEADS="${NUM_ATTENTION_HEADS-32}"
export NUM_QUERY_GROUPS="${NUM_QUERY_GROUPS-8}"
export FFN_HIDDEN_SIZE="${FFN_HIDDEN_SIZE-14336}"
export NUM_EXPERTS="${NUM_EXPERTS-8}"
export MOE_ROUTER_TOPK="${MOE_ROUTER_TOPK-2}"
export SEQ_LENGTH="${SEQ_LENGTH-4096}"
export GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE-256}"
export HOSTS="${HOSTS-$(seq -f '192.168.10.%g' -s , 1 "$NNODES")}"  # bootstrap addresses, node-rank order
export DATA_PATH="${DATA_PATH-/data/mixtral/corpus_text_document}"
export TOKENIZER_TYPE="${TOKENIZER_TYPE-HuggingFaceTokenizer}"
export TOKENIZER_MODEL="${TOKENIZER_MODEL-/data/hf/Mixtral-8x7B-v0.1}"
export CHECKPOINT_LOAD="${CHECKPOINT_LOAD-/data/mixtral/8x7b-mcore}"
export CHECKPOINT_SAVE="${CHECKPOINT_SAVE-/data/mixtral/8x7b-ckpt}"
export LOG_DIR="${LOG_DIR-./logs/mixtral_8x7b}"

ARGS=(
    --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-experts "$NUM_EXPERTS" --moe-router-topk "$MOE_ROUTER_TOPK" --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.02 --moe-grouped-gemm
    --swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 1000000
    --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
    --use-flash-attn
)
source "$HERE/lib/launch.sh"
launch_recipe mixtral_8x7b.sh "$@"
