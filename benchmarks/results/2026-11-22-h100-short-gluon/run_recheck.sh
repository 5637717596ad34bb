export PYTHONPATH=src
for r in 1 2; do timeout 120 python scripts/tune.py --seqlen 256,384,512 --hdims 128 --loads triton,gluon --kernels fwd 2>&1; done | tee $OUT/tune_fwd_recheck.log
timeout 120 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 128 --modes fwd --causal false --seqlens 256,384,512 --out $OUT/bench_fwd_recheck 2>&1 | tail -6
