export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -n 8 -k "hopper_forward" 2>&1 | tail -3 | tee $OUT/gpu_tests_short.log
timeout 250 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 128 --modes fwd --seqlens 128,256,512,1024 --out $OUT/bench_fwd_short 2>&1 | tail -12
