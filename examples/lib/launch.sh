# Sourced by every recipe in examples/ once ARGS holds the model's flags: the layout switches the recipe's
# environment gives (virtual stages, EP, uneven end stages, recompute) become flags, and the two-node
# launcher (scripts/pretrain_gpt_8x2.sh: node list, HCCL environment, rank-map check, checkpoints, logs) runs them.

launch_recipe() {
    local recipe=$1
    shift
    if [ "${VPP:-0}" != "0" ]; then ARGS+=(--num-virtual-stages-per-pipeline-rank "$VPP"); fi
    if [ "${EP:-1}" != "1" ]; then ARGS+=(--expert-model-parallel-size "$EP"); fi
    if [ -n "${FIRST_STAGE_LAYERS:-}" ]; then  # uneven pipeline stages
        ARGS+=(--decoder-first-pipeline-num-layers "$FIRST_STAGE_LAYERS" --decoder-last-pipeline-num-layers "$LAST_STAGE_LAYERS")
    fi
    case "${RECOMPUTE:-none}" in
        none) ;;
        full) ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
        *) echo "$recipe: RECOMPUTE must be none or full, got '$RECOMPUTE'" >&2; exit 2 ;;
    esac
    export EXTRA_ARGS="${ARGS[*]} ${EXTRA_ARGS-}"
    exec bash "$(dirname "${BASH_SOURCE[0]}")/../../scripts/pretrain_gpt_8x2.sh" "$@"
}
