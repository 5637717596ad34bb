export PYTHONPATH=src
R=benchmarks/results/2026-11-22-h100-after-epilogue
timeout 150 python $R/kernel_times.py 64,128 1024,4096,16384 2>&1 | tee $OUT/kernel_times.log
for round in 1 2; do
  timeout 200 python scripts/tune.py --loads triton,gluon2 --kernels fwd --hdims 64,128 --seqlen 512,1024,2048 2>&1 | tee $OUT/tune_fwd_gluon_round$round.log
done
# second call: the D=64 non-causal forward over the 257-512 key class
for round in 1 2; do
  timeout 120 python scripts/tune.py --loads triton,gluon2 --kernels fwd --hdims 64 --seqlen 320,384,448,512 2>&1 | tee $OUT/tune_fwd_d64_class2_round$round.log
done
