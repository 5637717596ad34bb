export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
for r in 1 2; do timeout 150 python scripts/tune.py --seqlen 384,512 --hdims 128 --loads triton,gluon --kernels dkdv,dq 2>&1; done | tee $OUT/tune_bwd_class2.log
