export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 256 --modes fwd,bwd --out $OUT/bench_d256 2>&1 | grep -v "^\[" | tail -30
timeout 200 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --seqlens 128,256 --modes fwd,bwd --out $OUT/bench_short 2>&1 | grep -v "^\[" | tail -20
