#!/usr/bin/env bash
# DeepSeek-V3 (671B: MLA, 256 experts top-8 + a shared expert, 3 dense layers, MTP) on 64 Atlas 800T A2 nodes (512 x 910B, 64 GB).
# Layout: what `megatron-npu plan --search` chose (first of its ranked layouts) for this model and cluster
# (--vocab-size: the Hugging Face config's vocab_size, the converted embedding's rows):
#   megatron-npu plan --search --nnodes 64 --nproc-per-node 8 <the model flags below> --bf16 --global-batch-size 1024 --vocab-size 129280
#   TP 8 x DP 64 (EP 64: 4 experts per rank), one pipeline stage of the 61 layers and MTP,
#   predicted memory: 56.0 GB per card (GB = 1e9 bytes; 64 GB less 10% headroom fits);
#   micro-batch 1, full recompute, distributed optimizer; predicted throughput: 317 tokens/s per NPU, MFU 23.3%
#   (a model: megatron_npu/layout/step_time.py; its MoE GEMMs at the dense ones' efficiency: docs/planning.md).
#
# Data and checkpoint (once, on shared storage):
#   megatron-npu preprocess --input corpus.jsonl --output-prefix /data/deepseek/corpus \
#       --tokenizer-type HuggingFaceTokenizer --tokenizer-model /data/hf/DeepSeek-V3-bf16 --append-eod --workers 32
#   megatron-npu convert to-megatron /data/hf/DeepSeek-V3-bf16 /data/deepseek/v3-mcore --tp $TP --pp $PP --ep $EP
#
# Run: bash examples/deepseek_v3.sh [--node-rank N] [--dry-run]   (HOSTS=ip0,ip1,... in node-rank order;
# --dry-run prints every node's environment and command and runs nothing). The launcher is
# scripts/pretrain_gpt_8x2.sh (node list, HCCL environment, rank-map check, checkpoints, logs).
#
# Every size and degree below is an environment variable (e.g. NUM_LAYERS=2 HIDDEN_SIZE=64); the CPU
# smoke test tests/examples/test_recipes.py runs this script scaled down that way for 2 iterations.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

export NNODES="${NNODES-64}"
export NPROC_PER_NODE="${NPROC_PER_NODE-8}"
export TP="${TP-8}"
export PP="${PP-1}"
export CP="${CP-1}"
export VPP="${VPP-0}"
export EP="${EP-64}"
export FIRST_STAGE_LAYERS="${FIRST_STAGE_LAYERS-}"
export LAST_STAGE_LAYERS="${LAST_STAGE_LAYERS-}"
export MICRO_BATCH_SIZE="${MICRO_BATCH_SIZE-1}"
export RECOMPUTE="${RECOMPUTE-full}"
export NUM_LAYERS="${NUM_LAYERS-61}"
export HIDDEN_SIZE="${HIDDEN_SIZE-7168}"
export NUM_ATTENTION_HEADS="${NUM_ATTENTION_HEADS-128}"
export Q_LORA_RANK="${Q_LORA_RANK-1536}"
export KV_LORA_RANK="${KV_LORA_RANK-512}"
export QK_HEAD_DIM="${QK_HEAD_DIM-128}"
export QK_POS_EMB_HEAD_DIM="${QK_POS_EMB_HEAD_DIM-64}"
export V_HEAD_DIM="${V_HEAD_DIM-128}"
export FFN_HIDDEN_SIZE="${FFN_HIDDEN_SIZE-18432}"
export NUM_EXPERTS="${NUM_EXPERTS-256}"
export MOE_ROUTER_TOPK="${MOE_ROUTER_TOPK-8}"
export MOE_FFN_HIDDEN_SIZE="${MOE_FFN_HIDDEN_SIZE-2048}"
export DENSE_LAYERS="${DENSE_LAYERS-3}"
export MTP_NUM_LAYERS="${MTP_NUM_LAYERS-1}"
export SEQ_LENGTH="${SEQ_LENGTH-4096}"
export GLOBAL_BATCH_SIZE="${GLOBAL_BATCH_SIZE-1024}"
export HOSTS="${HOSTS-$(seq -f '192.168.10.%g' -s , 1 "$NNODES")}"  # bootstrap addresses, node-rank order
export DATA_PATH="${DATA_PATH-/data/deepseek/corpus_text_document}"
export TOKENIZER_TYPE="${TOKENIZER_TYPE-HuggingFaceTokenizer}"
export TOKENIZER_MODEL="${TOKENIZER_MODEL-/data/hf/DeepSeek-V3-bf16}"
export CHECKPOINT_LOAD="${CHECKPOINT_LOAD-/data/deepseek/v3-mcore}"
export CHECKPOINT_SAVE="${CHECKPOINT_SAVE-/data/deepseek/v3-ckpt}"
export LOG_DIR="${LOG_DIR-./logs/deepseek_v3}"

ARGS=(
    --multi-latent-attention --q-lora-rank "$Q_LORA_RANK" --kv-lora-rank "$KV_LORA_RANK" --qk-head-dim "$QK_HEAD_DIM" --qk-pos-emb-head-dim "$QK_POS_EMB_HEAD_DIM" --v-head-dim "$V_HEAD_DIM" --qk-layernorm
    --ffn-hidden-size "$FFN_HIDDEN_SIZE" --num-experts "$NUM_EXPERTS" --moe-router-topk "$MOE_ROUTER_TOPK" --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE" --moe-shared-expert-intermediate-size "$MOE_FFN_HIDDEN_SIZE"
    --moe-layer-freq "([0]*$DENSE_LAYERS+[1]*$((NUM_LAYERS - DENSE_LAYERS)))" --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5
    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-grouped-gemm
    --mtp-num-layers "$MTP_NUM_LAYERS" --mtp-loss-scaling-factor 0.1
    --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0
    --use-flash-attn
)
source "$HERE/lib/launch.sh"
launch_recipe deepseek_v3.sh "$@"
