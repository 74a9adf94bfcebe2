#!/usr/bin/env bash
# gpt-oss-20b (MoE: 32 experts top-4, alternating sliding-window attention) on 1 Atlas 800T A2 node (8 x 910B, 64 GB).
# Layout: what `megatron-npu plan --search` chose (first of its ranked layouts) for this model and cluster
# (--vocab-size: the Hugging Face config's vocab_size, the converted embedding's rows):
#   megatron-npu plan --search --nnodes 1 --nproc-per-node 8 <the model flags below> --bf16 --global-batch-size 128 --vocab-size 201088
#   TP 1 x CP 8 x DP 1 (EP 8: gpt-oss's biased experts train at expert TP 1; the ring runs its sliding windows
#   and sinks), micro-batch 1, no recompute, distributed optimizer over the CP group;
#   predicted memory: 52.7 GB per card (GB = 1e9 bytes; 64 GB less 10% headroom fits);
#   predicted throughput: 9,775 tokens/s per NPU, MFU 50.1% (a model: megatron_npu/layout/step_time.py).
#
# Data and checkpoint (once, on shared storage):
#   megatron-npu preprocess --input corpus.jsonl --output-prefix /data/gpt-oss/corpus \
#       --tokenizer-type HuggingFaceTokenizer --tokenizer-model /data/hf/gpt-oss-20b-bf16 --append-eod --workers 32
#   megatron-npu convert to-megatron /data/hf/gpt-oss-20b-bf16 /data/gpt-oss/20b-mcore --tp $TP --pp $PP --ep $EP
#
# Run: bash examples/gpt_oss_20b.sh [--node-rank N] [--dry-run]   (HOSTS=ip0,ip1,... in node-rank order;
# --dry-run prints every node's environment and command and runs nothing). The launcher is
# scripts/pretrain_gpt_8x2.sh (node list, HCCL environment, rank-map check, checkpoints, logs).
#
# Every size and degree below is an environment variable (e.g. NUM_LAYERS=2 HIDDEN_SIZE=64); the CPU
# smoke test tests/examples/test_recipes.py runs this script scaled down that way for 2 iterations.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

export NNODES="${NNODES-1}"
export NPROC_PER_NODE="${NPROC_PER_NODE-8}"
export TP="${TP-1}"
export PP="${PP-1}"
export CP="${CP-8}"
export VPP="${VPP-0}"
export EP="${EP-8}"
export MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE-1}"
export RECOMPUTE="${RECOMPUTE-none}"
export NUM_LAYERS="${NUM_LAYERS-24}"
export HIDDEN_SIZE="${HIDDEN_SIZE-2880}"
export NUM_ATTENTION_HEADS="${NUM_ATTENTION_HEADS-64}"
export NUM_QUERY_GROUPS="${NUM_QUERY_GROUPS-8}"
export KV_CHANNELS="${KV_CHANNELS-64}"
export FFN_HIDDEN_SIZE="${FFN_HIDDEN_SIZE-2880}"
export NUM_EXPERTS="${NUM_EXPERTS-32}"
export MOE_ROUTER_TOPK="${MOE_ROUTER_TOPK-4}"
export WINDOW="${WINDOW-128}"
export SEQ_LENGTH="${SEQ_LENGTH-4096}"
export GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE-128}"
export HOSTS="${HOSTS-$(seq -f '192.168.10.%g' -s , 1 "$NNODES")}"  # bootstrap addresses, node-rank order
export DATA_PATH="${DATA_PATH-/data/gpt-oss/corpus_text_document}"
export TOKENIZER_TYPE="${TOKENIZER_TYPE-HuggingFaceTokenizer}"
export TOKENIZER_MODEL="${TOKENIZER_MODEL-/data/hf/gpt-oss-20b-bf16}"
export CHECKPOINT_LOAD="${CHECKPOINT_LOAD-/data/gpt-oss/20b-mcore}"
export CHECKPOINT_SAVE="${CHECKPOINT_SAVE-/data/gpt-oss/20b-ckpt}"
export LOG_DIR="${LOG_DIR-./logs/gpt_oss_20b}"

ARGS=(
    --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS" --kv-channels "$KV_CHANNELS" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-experts "$NUM_EXPERTS" --moe-router-topk "$MOE_ROUTER_TOPK" --moe-ffn-hidden-size "$FFN_HIDDEN_SIZE" --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --window-size "$WINDOW,0" --window-attn-skip-freq 2 --softmax-type learnable
    --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 --add-qkv-bias
    --normalization RMSNorm --position-embedding-type rope --rotary-base 150000 --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
    --use-flash-attn
)
source "$HERE/lib/launch.sh"
launch_recipe gpt_oss_20b.sh "$@"
