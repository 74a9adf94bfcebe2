#!/usr/bin/env bash
# LLaMA-3.1-70B pretraining on 4 Atlas 800T A2 nodes (32 x 910B, 64 GB).
# Layout: what `megatron-npu plan --search` chose (first of its ranked layouts) for this model and cluster
# (--vocab-size: the Hugging Face config's vocab_size, the converted embedding's rows):
#   megatron-npu plan --search --nnodes 4 --nproc-per-node 8 <the model flags below> --bf16 --global-batch-size 512 --vocab-size 128256
#   TP 4 x PP 4 x CP 2 x DP 1, stages of 18 / 21 / 21 / 20 layers, micro-batch 1, full recompute, distributed optimizer;
#   predicted memory: 51.1 (first stage) / 55.5 (middle, at most) / 55.4 (last) GB per card (GB = 1e9 bytes; 64 GB less 10% headroom fits);
#   predicted throughput: 308 tokens/s per NPU, MFU 39.1% (a model: megatron_npu/layout/step_time.py).
#
# Data and checkpoint (once, on shared storage):
#   megatron-npu preprocess --input corpus.jsonl --output-prefix /data/llama31/corpus \
#       --tokenizer-type HuggingFaceTokenizer --tokenizer-model /data/hf/Llama-3.1-70B --append-eod --workers 32
#   megatron-npu convert to-megatron /data/hf/Llama-3.1-70B /data/llama31/70b-mcore --tp $TP --pp $PP
#
# Run: bash examples/llama31_70b_4nodes.sh [--node-rank N] [--dry-run]   (HOSTS=ip0,ip1,... in node-rank order;
# --dry-run prints every node's environment and command and runs nothing). The launcher is
# scripts/pretrain_gpt_8x2.sh (node list, HCCL environment, rank-map check, checkpoints, logs).
#
# Every size and degree below is an environment variable (e.g. NUM_LAYERS=2 HIDDEN_SIZE=64); the CPU
# smoke test tests/examples/test_recipes.py runs this script scaled down that way for 2 iterations.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

export NNODES="${NNODES-4}"
export NPROC_PER_NODE="${NPROC_PER_NODE-8}"
export TP="${TP-4}"
export PP="${PP-4}"
export CP="${CP-2}"
export VPP="${VPP-0}"
export MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE-1}"
export RECOMPUTE="${RECOMPUTE-full}"
export NUM_LAYERS="${NUM_LAYERS-80}"
export HIDDEN_SIZE="${HIDDEN_SIZE-8192}"
export NUM_ATTENTION_HEADS="${NUM_ATTENTION_HEADS-64}"
export NUM_QUERY_GROUPS="${NUM_QUERY_GROUPS-8}"
export FFN_HIDDEN_SIZE="${FFN_HIDDEN_SIZE-28672}"
export SEQ_LENGTH="${SEQ_LENGTH-8192}"
export GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE-512}"
export FIRST_STAGE_LAYERS="${FIRST_STAGE_LAYERS-18}"
export LAST_STAGE_LAYERS="${LAST_STAGE_LAYERS-20}"
export HOSTS="${HOSTS-$(seq -f '192.168.10.%g' -s , 1 "$NNODES")}"  # bootstrap addresses, node-rank order
export DATA_PATH="${DATA_PATH-/data/llama31/corpus_text_document}"
export TOKENIZER_TYPE="${TOKENIZER_TYPE-HuggingFaceTokenizer}"
export TOKENIZER_MODEL="${TOKENIZER_MODEL-/data/hf/Llama-3.1-70B}"
export CHECKPOINT_LOAD="${CHECKPOINT_LOAD-/data/llama31/70b-mcore}"
export CHECKPOINT_SAVE="${CHECKPOINT_SAVE-/data/llama31/70b-ckpt}"
export LOG_DIR="${LOG_DIR-./logs/llama31_70b_4nodes}"

ARGS=(
    --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --swiglu --normalization RMSNorm --position-embedding-type rope --rotary-base 500000 --use-rope-scaling
    --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
    --use-flash-attn
)
source "$HERE/lib/launch.sh"
launch_recipe llama31_70b_4nodes.sh "$@"
