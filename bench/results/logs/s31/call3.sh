#!/usr/bin/env bash
# Session 31 call 3: every GPU test on this code, then #7's e2e tables (one GPU) with the servers' host split.
export PYTHONUNBUFFERED=1
OUT=$OUT TAIL=30 TESTS_S=300 E2E_S=270 E2E_DEADLINE=250 bash bench/gpu_suite.sh tests e2e
