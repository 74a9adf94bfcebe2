#!/usr/bin/env bash
# Qwen3-30B-A3B (MoE: 128 experts, top-8) pretraining on 2 Atlas 800T A2 nodes (16 x 910B, 64 GB).
# Layout: what `megatron-npu plan --search` chose (first of its ranked layouts) for this model and cluster
# (--vocab-size: the Hugging Face config's vocab_size, the converted embedding's rows):
#   megatron-npu plan --search --nnodes 2 --nproc-per-node 8 <the model flags below> --bf16 --global-batch-size 256 --vocab-size 151936
#   TP 2 x PP 4 x CP 2 x DP 1 (EP 1), stages of 12 layers, micro-batch 1, no recompute, distributed optimizer;
#   predicted memory: 56.4 (first stage) / 52.2 (middle, at most) / 49.8 (last) GB per card (GB = 1e9 bytes; 64 GB less 10% headroom fits);
#   predicted throughput: 6,476 tokens/s per NPU, MFU 42.2% (a model: megatron_npu/layout/step_time.py).
#
# Data and checkpoint (once, on shared storage):
#   megatron-npu preprocess --input corpus.jsonl --output-prefix /data/qwen3/corpus \
#       --tokenizer-type HuggingFaceTokenizer --tokenizer-model /data/hf/Qwen3-30B-A3B --append-eod --workers 32
#   megatron-npu convert to-megatron /data/hf/Qwen3-30B-A3B /data/qwen3/30b-a3b-mcore --tp $TP --pp $PP --ep $EP
#
# Run: bash examples/qwen3_30b_a3b.sh [--node-rank N] [--dry-run]   (HOSTS=ip0,ip1,... in node-rank order;
# --dry-run prints every node's environment and command and runs nothing). The launcher is
# scripts/pretrain_gpt_8x2.sh (node list, HCCL environment, rank-map check, checkpoints, logs).
#
# Every size and degree below is an environment variable (e.g. NUM_LAYERS=2 HIDDEN_SIZE=64); the CPU
# smoke test tests/examples/test_recipes.py runs this script scaled down that way for 2 iterations.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

export NNODES="${NNODES-2}"
export NPROC_PER_NODE="${NPROC_PER_NODE-8}"
export TP="${TP-2}"
export PP="${PP-4}"
export CP="${CP-2}"
export VPP="${VPP-0}"
export EP="${EP-1}"
export MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE-1}"
export RECOMPUTE="${RECOMPUTE-none}"
export NUM_LAYERS="${NUM_LAYERS-48}"
export HIDDEN_SIZE="${HIDDEN_SIZE-2048}"
export NUM_ATTENTION_HEADS="${NUM_ATTENTION_HEADS-32}"
export NUM_QUERY_GROUPS="${NUM_QUERY_GROUPS-4}"
export KV_CHANNELS="${KV_CHANNELS-128}"
export FFN_HIDDEN_SIZE="${FFN_HIDDEN_SIZE-6144}"
export NUM_EXPERTS="${NUM_EXPERTS-128}"
export MOE_ROUTER_TOPK="${MOE_ROUTER_TOPK-8}"
export MOE_FFN_HIDDEN_SIZE="${MOE_FFN_HIDDEN_SIZE-768}"
export SEQ_LENGTH="${SEQ_LENGTH-4096}"
export GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE-256}"
export FIRST_STAGE_LAYERS="${FIRST_STAGE_LAYERS-}"  # even stages
export LAST_STAGE_LAYERS="${LAST_STAGE_LAYERS-}"
export HOSTS="${HOSTS-$(seq -f '192.168.10.%g' -s , 1 "$NNODES")}"  # bootstrap addresses, node-rank order
export DATA_PATH="${DATA_PATH-/data/qwen3/corpus_text_document}"
export TOKENIZER_TYPE="${TOKENIZER_TYPE-HuggingFaceTokenizer}"
export TOKENIZER_MODEL="${TOKENIZER_MODEL-/data/hf/Qwen3-30B-A3B}"
export CHECKPOINT_LOAD="${CHECKPOINT_LOAD-/data/qwen3/30b-a3b-mcore}"
export CHECKPOINT_SAVE="${CHECKPOINT_SAVE-/data/qwen3/30b-a3b-ckpt}"
export LOG_DIR="${LOG_DIR-./logs/qwen3_30b_a3b}"

ARGS=(
    --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS" --kv-channels "$KV_CHANNELS" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-experts "$NUM_EXPERTS" --moe-router-topk "$MOE_ROUTER_TOPK" --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE"
    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --moe-grouped-gemm
    --qk-layernorm --swiglu --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope --rotary-base 1000000
    --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
    --use-flash-attn
)
source "$HERE/lib/launch.sh"
launch_recipe qwen3_30b_a3b.sh "$@"
