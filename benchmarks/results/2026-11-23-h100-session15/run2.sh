#!/bin/bash
# Device run 2 of session 15: where the host's time goes, backward step and forward call.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/results/2026-11-23-h100-session15/host_bwd_parts.py 2>&1 | tee $OUT/host_bwd_parts.log
timeout 200 python3 benchmarks/results/2026-11-23-h100-session15/host_fwd_parts.py 2>&1 | tee $OUT/host_fwd_parts.log
