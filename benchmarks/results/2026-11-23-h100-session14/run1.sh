#!/bin/bash
# Device run 1 of session 14: the Gluon forward's tiles (ab_fwd_tiles.py, two rounds) and the short
# backward rows' host time (bwd_host.py). From the repository root: bash <this> (writes under $OUT).
R=benchmarks/results/2026-11-23-h100-session14
export PYTHONPATH=src
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.backends.cudnn.version())" >> $OUT/gpu.txt
timeout 420 python $R/ab_fwd_tiles.py 64,128 512,768,1024,1536,2048 2 > $OUT/ab_fwd_tiles.log 2>&1
timeout 150 python $R/bwd_host.py > $OUT/bwd_host.log 2>&1
tail -3 $OUT/*.log
