#!/usr/bin/env bash
# Runs a command in the slim vLLM's environment when it is installed (VLLM_SITE, default /tmp/vllm-site: the 0.26
# kit, ../shared/vllm/README.md on the GPU machine; /tmp/vllm24-site holds the 0.24 kit: PYTHONPATH first,
# VLLM_USE_FLASHINFER_SAMPLER=0, offline flags), keeping the caller's PYTHONPATH after it; elsewhere (the CPU twin
# of a GPU run) the command runs unchanged.
site=${VLLM_SITE:-/tmp/vllm-site}
if [ -f "$site/vllm-env.sh" ]; then
  base=${PYTHONPATH:-}
  # shellcheck disable=SC1091
  . "$site/vllm-env.sh"
  export PYTHONPATH=${PYTHONPATH:-}${base:+:$base}
fi
exec "$@"
