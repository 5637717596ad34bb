export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 500 python scripts/tune.py --seqlen 256,512 --loads triton,gluon,fused --kernels fwd,dkdv,dq 2>&1 | tee $OUT/tune_short.log
