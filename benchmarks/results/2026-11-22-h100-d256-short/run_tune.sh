export PYTHONPATH=src
timeout 560 python scripts/tune.py --hdims 256 --seqlen 2048,8192 --kernels dkdv,dq 2>&1 | grep -v Warn | tee $OUT/tune_d256_bwd.log
