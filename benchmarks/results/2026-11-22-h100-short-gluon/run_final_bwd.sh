export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 8 -k "hopper_short or hopper_forward or (hopper_backward and bfloat16)" 2>&1 | tail -3 | tee $OUT/gpu_tests_class2_bwd.log
timeout 150 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 128 --modes bwd --causal false --seqlens 256,384,512 --out $OUT/bench_bwd_class2 2>&1 | tail -6
