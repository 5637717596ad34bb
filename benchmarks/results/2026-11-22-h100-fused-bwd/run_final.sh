export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 320 python -m pytest tests -q -p no:cacheprovider -m gpu -n 15 2>&1 | tail -6 | tee $OUT/gpu_tests_final.log
timeout 260 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes bwd --seqlens 512,1024,2048,4096,8192,16384 --out $OUT/bench_bwd_final 2>&1 | tail -30
