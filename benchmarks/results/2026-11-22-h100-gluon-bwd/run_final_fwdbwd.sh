export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes fwd+bwd --seqlens 1024,2048,4096,8192,16384 --out $OUT/bench_fwdbwd_final 2>&1 | tail -23
timeout 200 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 128 --dtype fp16 --modes bwd --seqlens 1024,2048,4096,8192,16384 --out $OUT/bench_bwd_fp16 2>&1 | tail -13
