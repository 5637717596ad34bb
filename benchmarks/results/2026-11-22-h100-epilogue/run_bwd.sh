export PYTHONPATH=src
timeout 300 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes bwd --out $OUT/bench_bwd 2>&1 | tail -30
