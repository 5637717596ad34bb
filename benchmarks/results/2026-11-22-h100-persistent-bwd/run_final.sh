export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -m pytest tests -q -p no:cacheprovider -m gpu -n 15 2>&1 | tail -3 | tee $OUT/gpu_tests_final.log
timeout 200 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes bwd --out $OUT/bench_bwd 2>&1 | tail -28
