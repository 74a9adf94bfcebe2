#!/usr/bin/env bash
# GPT ~13B (40 layers, hidden 5120, 40 heads, seq 4096, bf16) on 2 nodes x 8 Ascend NPUs
# (Atlas 800T A2): TP8 inside each node (HCCS), PP2 across the nodes (RoCE), distributed
# optimizer, sequence parallelism.
#
#   bash scripts/pretrain_gpt_8x2.sh --node-rank 0     # on the first host
#   bash scripts/pretrain_gpt_8x2.sh --node-rank 1     # on the second host
#   bash scripts/pretrain_gpt_8x2.sh                   # node rank found by matching HOSTS
#   bash scripts/pretrain_gpt_8x2.sh --dry-run         # print every node's command, run nothing
#
# Every setting below can be overridden from the environment, e.g. a scaled-down two-agent
# cpu run on one machine (tests/layout/test_two_node.py runs this):
#   MEGATRON_NPU_DEVICE=cpu HOSTS=127.0.0.1,127.0.0.1 MASTER_ADDR=127.0.0.1 NPROC_PER_NODE=2 TP=2 PP=2 \
#     NUM_LAYERS=4 HIDDEN_SIZE=64 NUM_ATTENTION_HEADS=4 SEQ_LENGTH=128 GLOBAL_BATCH_SIZE=4 TRAIN_ITERS=4 \
#     LR_WARMUP_ITERS=1 DTYPE=fp32 CHECKPOINT_SAVE= LOG_DIR=/tmp/gpt-logs \
#     DATA_PATH= TOKENIZER_TYPE=NullTokenizer TOKENIZER_MODEL= EXTRA_ARGS="--mock-data --vocab-size 1024" \
#     bash scripts/pretrain_gpt_8x2.sh --node-rank 0   # and --node-rank 1 in a second shell
# An empty DATA_PATH, TOKENIZER_MODEL or CHECKPOINT_SAVE drops those flags; DTYPE=fp32 drops --bf16
# (the cpu target); SEQUENCE_PARALLEL=0 / DISTRIBUTED_OPTIMIZER=0 / EXIT_SIGNAL_HANDLER=0 drop those flags.
set -euo pipefail

# ---- paths --------------------------------------------------------------------------------
DATA_PATH=${DATA_PATH-/data/gpt/corpus_text_document}  # .bin/.idx prefix from preprocess_data.py
TOKENIZER_TYPE=${TOKENIZER_TYPE:-GPTSentencePieceTokenizer}
TOKENIZER_MODEL=${TOKENIZER_MODEL-/data/gpt/tokenizer.model}
CHECKPOINT_SAVE=${CHECKPOINT_SAVE-/data/gpt/checkpoints/gpt-13b}  # empty: no --save/--load
CHECKPOINT_LOAD=${CHECKPOINT_LOAD-$CHECKPOINT_SAVE}
LOG_DIR=${LOG_DIR:-./logs/gpt-13b-8x2}
CANN_SET_ENV=${CANN_SET_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}

# ---- cluster ------------------------------------------------------------------------------
HOSTS=${HOSTS:-192.168.10.1,192.168.10.2}  # bootstrap addresses, in node-rank order
NNODES=${NNODES:-2}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-${HOSTS%%,*}}
MASTER_PORT=${MASTER_PORT:-6000}
PYTHON=${PYTHON:-python}
TORCHRUN=${TORCHRUN:-"$PYTHON -m torch.distributed.run"}
RANK_MAP_CHECK=${RANK_MAP_CHECK:-1}

# ---- parallelism and model ----------------------------------------------------------------
TP=${TP:-8}
PP=${PP:-2}
CP=${CP:-1}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL:-1}
DISTRIBUTED_OPTIMIZER=${DISTRIBUTED_OPTIMIZER:-1}
DTYPE=${DTYPE:-bf16}  # bf16 | fp16 | fp32 (fp32: no precision flag; the cpu target)
NUM_LAYERS=${NUM_LAYERS:-40}
HIDDEN_SIZE=${HIDDEN_SIZE:-5120}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-40}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
MAX_POSITION_EMBEDDINGS=${MAX_POSITION_EMBEDDINGS:-$SEQ_LENGTH}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-64}  # DP=1 here: 64 microbatches keep the PP bubble small
TRAIN_ITERS=${TRAIN_ITERS:-50000}
LR=${LR:-1.5e-4}
MIN_LR=${MIN_LR:-1.5e-5}
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-2000}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}
LOG_INTERVAL=${LOG_INTERVAL:-1}
TIMING_LOG_LEVEL=${TIMING_LOG_LEVEL:-1}  # 2 adds per-group communication bytes to LOG_DIR/timers
EXIT_SIGNAL_HANDLER=${EXIT_SIGNAL_HANDLER:-1}  # SIGTERM: save and exit (one small world all-reduce per iteration)
EXTRA_ARGS=${EXTRA_ARGS:-}

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

NODE_RANK=${NODE_RANK:-}
DRY_RUN=0
while [ $# -gt 0 ]; do
    case "$1" in
        --node-rank) NODE_RANK=${2:?--node-rank needs a value}; shift 2 ;;
        --node-rank=*) NODE_RANK=${1#*=}; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "pretrain_gpt_8x2.sh: unknown argument '$1' (use --node-rank N, --dry-run; model flags go in EXTRA_ARGS)" >&2; exit 2 ;;
    esac
done

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(dirname "$SCRIPT_DIR")
IFS=',' read -r -a HOST_LIST <<< "$HOSTS"
if [ "${#HOST_LIST[@]}" -ne "$NNODES" ]; then
    echo "pretrain_gpt_8x2.sh: HOSTS lists ${#HOST_LIST[@]} hosts but NNODES=$NNODES" >&2
    exit 2
fi

# This host's addresses, to find NODE_RANK in HOSTS.
local_addresses() {
    { hostname -I 2>/dev/null || true; ip -o -4 addr show 2>/dev/null | awk '{print $4}' | cut -d/ -f1 || true;
      hostname 2>/dev/null || true; hostname -f 2>/dev/null || true; } | tr ' ' '\n' | sed '/^$/d'
}

if [ -z "$NODE_RANK" ] && [ "$DRY_RUN" -eq 0 ]; then
    mine=$(local_addresses)
    for i in "${!HOST_LIST[@]}"; do
        if grep -qxF "${HOST_LIST[$i]}" <<< "$mine"; then
            if [ -n "$NODE_RANK" ]; then
                echo "pretrain_gpt_8x2.sh: this host matches several HOSTS entries; pass --node-rank N" >&2
                exit 2
            fi
            NODE_RANK=$i
        fi
    done
    if [ -z "$NODE_RANK" ]; then
        echo "pretrain_gpt_8x2.sh: none of this host's addresses is in HOSTS=$HOSTS; pass --node-rank N" >&2
        exit 2
    fi
fi
if [ -n "$NODE_RANK" ] && ! { [[ "$NODE_RANK" =~ ^[0-9]+$ ]] && [ "$NODE_RANK" -lt "$NNODES" ]; }; then
    echo "pretrain_gpt_8x2.sh: --node-rank must be 0..$((NNODES - 1)), got '$NODE_RANK'" >&2
    exit 2
fi

# A node's own address: its HOSTS entry (resolved when it is a name). HCCL_IF_IP must be the address of
# the node that runs the ranks, so a dry run prints each node's, never the address of the machine it runs on.
node_ip() {  # $1 node rank
    local entry=${HOST_LIST[$1]}
    if [[ "$entry" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then echo "$entry"; return; fi
    getent ahostsv4 "$entry" 2>/dev/null | awk 'NR == 1 {print $1}' || true
}

# The interface this host uses toward MASTER_ADDR: gloo's NIC (and HCCL's IP when HOSTS names are unresolvable).
route_to_master() {  # prints "SRC_IP DEV", empty when unknown
    ip route get "$MASTER_ADDR" 2>/dev/null | awk '{for (i = 1; i < NF; i++) {if ($i == "src") s = $(i + 1); if ($i == "dev") d = $(i + 1)}} END {if (s != "") print s, d}'
}

# ---- the HCCL / Ascend environment ----------------------------------------------------------
node_env() {  # $1 node rank; prints "export K=V" lines
    local node=$1 if_ip if_dev="" route
    if_ip=$(node_ip "$node")
    if [ "$DRY_RUN" -eq 0 ]; then  # running on this node: its route toward the master names gloo's NIC
        route=$(route_to_master)
        if [ -n "$route" ]; then if_dev=${route#* }; [ -n "$if_ip" ] || if_ip=${route%% *}; fi
    fi
    [ -n "$if_ip" ] || if_ip=${HOST_LIST[$node]}  # a name nothing resolves here: printed as given
    # HCCL's link set-up and collective timeouts follow --distributed-timeout-minutes (the patch
    # layer sets both before the process group exists); the ones you export win
    for var in HCCL_CONNECT_TIMEOUT HCCL_EXEC_TIMEOUT; do
        if [ -n "${!var:-}" ]; then echo "export $var=${!var}"; fi
    done
    echo "export HCCL_IF_IP=${HCCL_IF_IP:-$if_ip}"
    if [ -n "$if_dev" ] && [ "$if_dev" != "lo" ]; then echo "export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$if_dev}"; fi
    echo "export ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES:-$(seq -s, 0 $((NPROC_PER_NODE - 1)))}"
    echo "export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}"
    echo "export CUDA_DEVICE_MAX_CONNECTIONS=1"
    if [ -n "${RANK_TABLE_FILE:-}" ]; then echo "export RANK_TABLE_FILE=$RANK_TABLE_FILE"; fi
}

case "$DTYPE" in
    bf16|fp16|fp32) ;;
    *) echo "pretrain_gpt_8x2.sh: DTYPE must be bf16, fp16 or fp32, got '$DTYPE'" >&2; exit 2 ;;
esac
GPT_ARGS=(
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_ATTENTION_HEADS"
    --seq-length "$SEQ_LENGTH" --max-position-embeddings "$MAX_POSITION_EMBEDDINGS"
    --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE" --train-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$LR_WARMUP_ITERS"
)
if [ "$SEQUENCE_PARALLEL" = "1" ]; then GPT_ARGS+=(--sequence-parallel); fi
if [ "$DTYPE" != "fp32" ]; then GPT_ARGS+=("--$DTYPE"); fi
if [ "$DISTRIBUTED_OPTIMIZER" = "1" ]; then GPT_ARGS+=(--use-distributed-optimizer); fi
GPT_ARGS+=(--distributed-backend nccl)  # mapped to the device's backend (hccl on Ascend, gloo on cpu)
if [ "$CP" != "1" ]; then GPT_ARGS+=(--context-parallel-size "$CP"); fi
DATA_ARGS=()  # an empty DATA_PATH / TOKENIZER_MODEL drops the flag (e.g. EXTRA_ARGS="--mock-data ...")
if [ -n "$DATA_PATH" ]; then DATA_ARGS+=(--data-path "$DATA_PATH" --split 949,50,1); fi
DATA_ARGS+=(--tokenizer-type "$TOKENIZER_TYPE")
if [ -n "$TOKENIZER_MODEL" ]; then DATA_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL"); fi
# What a long job needs: a SIGTERM (a scheduler's preemption, passed on by torchrun) finishes the iteration
# in flight, saves and exits (--exit-signal-handler); checkpoints saved and resumed from the same directory;
# logs, timers and TensorBoard under LOG_DIR.
OUTPUT_ARGS=()
if [ "$EXIT_SIGNAL_HANDLER" = "1" ]; then OUTPUT_ARGS+=(--exit-signal-handler); fi
if [ -n "$CHECKPOINT_SAVE" ]; then
    OUTPUT_ARGS+=(--save "$CHECKPOINT_SAVE" --save-interval "$SAVE_INTERVAL" --ckpt-format torch_dist)
fi
if [ -n "$CHECKPOINT_LOAD" ]; then OUTPUT_ARGS+=(--load "$CHECKPOINT_LOAD"); fi
OUTPUT_ARGS+=(
    --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
    --timing-log-level "$TIMING_LOG_LEVEL" --log-dir "$LOG_DIR" --tensorboard-dir "$LOG_DIR/tensorboard"
)
read -r -a EXTRA <<< "$EXTRA_ARGS"

node_cmd() {  # $1 node rank; prints the launch command, shell-quoted
    local cmd
    read -r -a cmd <<< "$TORCHRUN"
    cmd+=(--nproc_per_node "$NPROC_PER_NODE" --nnodes "$NNODES" --node_rank "$1"
          --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
          "$REPO_DIR/pretrain_gpt.py" "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${EXTRA[@]}")
    printf '%q ' "${cmd[@]}"
    echo
}

# CANN first: the python below may import torch_npu (libascendcl, libhccl)
if [ "$DRY_RUN" -eq 0 ] && [ -f "$CANN_SET_ENV" ]; then
    set +u  # CANN's set_env.sh reads unset variables
    # shellcheck disable=SC1090
    source "$CANN_SET_ENV"
    set -u
fi

RANK_MAP_CMD=("$PYTHON" "$REPO_DIR/scripts/gen_rank_map.py" --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
              --tp "$TP" --pp "$PP" --cp "$CP" --num-layers "$NUM_LAYERS" --hosts "$HOSTS")
# the layout flags among EXTRA_ARGS (a recipe's EP, virtual or uneven stages): the map checks the split the trainer makes
read -r -a extra_words <<< "${EXTRA_ARGS:-}"
for i in "${!extra_words[@]}"; do
    case "${extra_words[$i]}" in
        --expert-model-parallel-size|--expert-tensor-parallel-size|--num-virtual-stages-per-pipeline-rank|\
        --decoder-first-pipeline-num-layers|--decoder-last-pipeline-num-layers|--pipeline-model-parallel-layout)
            RANK_MAP_CMD+=("${extra_words[$i]}" "${extra_words[$((i + 1))]}") ;;
        --account-for-embedding-in-pipeline-split|--account-for-loss-in-pipeline-split)
            RANK_MAP_CMD+=("${extra_words[$i]}") ;;
    esac
done
if [ "$RANK_MAP_CHECK" = "1" ]; then
    # refuses a TP group that would span nodes, or a layout that does not divide the world
    err_file=$(mktemp)
    if ! map=$("${RANK_MAP_CMD[@]}" 2>"$err_file"); then
        grep "rankmap: error" "$err_file" >&2 || tail -n 20 "$err_file" >&2
        rm -f "$err_file"
        exit 2
    fi
    rm -f "$err_file"
    echo "rank map ($(printf '%q ' "${RANK_MAP_CMD[@]}")):"
    grep -E "^(world|TP groups|PP boundaries|DP groups|CP groups)" <<< "$map" | sed 's/^/  /'
fi

if [ "$DRY_RUN" -eq 1 ]; then
    nodes=${NODE_RANK:-$(seq -s ' ' 0 $((NNODES - 1)))}
    for node in $nodes; do
        echo "# ---- node $node (${HOST_LIST[$node]}) ----"
        if [ -f "$CANN_SET_ENV" ]; then echo "source $CANN_SET_ENV"; fi
        node_env "$node"
        node_cmd "$node"
    done
    exit 0
fi

ENV_LINES=$(node_env "$NODE_RANK")
echo "$ENV_LINES"
eval "$ENV_LINES"
mkdir -p "$LOG_DIR"
read -r -a LAUNCH <<< "$TORCHRUN"
echo "node $NODE_RANK of $NNODES: $(node_cmd "$NODE_RANK")"
"${LAUNCH[@]}" --nproc_per_node "$NPROC_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    "$REPO_DIR/pretrain_gpt.py" "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${EXTRA[@]}" \
    2>&1 | tee -a "$LOG_DIR/node${NODE_RANK}.log"
