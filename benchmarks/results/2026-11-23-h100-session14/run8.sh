#!/bin/bash
# Device run 8 of session 14, the final table (64-key tiles up to 256 keys and causal up to 1k): the
# whole GPU suite, then the forward sweep from 128 keys (bf16; fp16 up to 1k).
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -m pytest tests -m gpu -q -n 15 -p no:cacheprovider > $OUT/gpu_tests_final.log 2>&1
tail -1 $OUT/gpu_tests_final.log
timeout 200 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes fwd \
  --seqlens 128,256,512,1024,2048,4096,8192,16384 --out $OUT/bench_fwd_final 2>&1 | tr '\r' '\n' | grep "^| none"
timeout 100 python3 -m cuflash bench --providers cuflash,sdpa-cudnn,sdpa-flash --hdims 64,128 --modes fwd \
  --seqlens 128,256,512,1024 --dtype fp16 --out $OUT/bench_fwd_fp16 2>&1 | tr '\r' '\n' | grep "^| none"
