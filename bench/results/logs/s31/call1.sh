#!/usr/bin/env bash
# Session 31 call 1: each server's host time split (engine_host vs serving) and the in-process
# `bare` table on one host; then the servers through CUDA MPS against without (alternating).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=$OUT TAIL=40 GAPS_S=140 GAPS_ARGS="--batches 1 8 --steps 16" E2E_AB_S=400 MPS_PASSES=2 \
  E2E_MPS_ARGS="--sections 7b --drafts llama-68m --deadline 100" bash bench/gpu_suite.sh gaps e2e-mps
