export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -m pytest tests -q -p no:cacheprovider -m gpu -n 15 2>&1 | tail -3 | tee $OUT/gpu_tests_final.log
timeout 200 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 128 --modes fwd --seqlens 256,384,512,1024 --out $OUT/bench_fwd_final 2>&1 | tail -12
