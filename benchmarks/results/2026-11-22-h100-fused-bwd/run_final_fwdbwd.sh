export PYTHONPATH=src
timeout 280 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64 --modes fwd+bwd --seqlens 512,1024,2048,4096,8192,16384 --out $OUT/bench_fwdbwd_d64 2>&1 | tail -20
timeout 250 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64 --dtype fp16 --modes bwd --seqlens 1024,4096,16384 --out $OUT/bench_bwd_fp16_d64 2>&1 | tail -12
