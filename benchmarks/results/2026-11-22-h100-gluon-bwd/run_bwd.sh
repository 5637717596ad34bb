export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -x -k "test_hopper_backward and bfloat16-128-False-1025-1025-bnhd" 2>&1 | tail -15
timeout 240 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -n 8 -k "test_hopper_backward" 2>&1 | tail -25 | tee $OUT/gpu_tests_hb2.log
timeout 300 python scripts/tune.py --loads triton,gluon --kernels dkdv,dq --seqlen 1024,4096,16384 --hdims 128,64 2>&1 | tee $OUT/ab_bwd2.log
