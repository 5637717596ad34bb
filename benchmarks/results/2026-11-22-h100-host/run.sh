export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -m pytest tests -q -p no:cacheprovider -m gpu -n 15 2>&1 | tail -3 | tee $OUT/gpu_tests.log
python scripts/overhead.py 2>&1 | grep -v Warn | tee $OUT/overhead.txt
timeout 200 python -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --seqlens 128,256 --modes fwd,bwd --out $OUT/bench_short 2>&1 | grep -v "^\[" | tail -20
