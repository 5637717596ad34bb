export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -m pytest tests -q -p no:cacheprovider -m gpu -n 15 2>&1 | tail -3 | tee $OUT/gpu_tests_final.log
timeout 240 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes fwd --out $OUT/bench_fwd 2>&1 | tail -30
