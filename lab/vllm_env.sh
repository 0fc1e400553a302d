#!/usr/bin/env bash
# Runs a command in the slim vLLM's environment when it is installed (/tmp/vllm-site, ../shared/vllm/README.md on
# the GPU machine: PYTHONPATH first, VLLM_USE_FLASHINFER_SAMPLER=0, offline flags), keeping the caller's PYTHONPATH
# after it; elsewhere (the CPU twin of a GPU run) the command runs unchanged.
if [ -f /tmp/vllm-site/vllm-env.sh ]; then
  base=${PYTHONPATH:-}
  # shellcheck disable=SC1091
  . /tmp/vllm-site/vllm-env.sh
  export PYTHONPATH=${PYTHONPATH:-}${base:+:$base}
fi
exec "$@"
