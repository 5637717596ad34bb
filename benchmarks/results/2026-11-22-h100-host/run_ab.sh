# Host time per call, committed tree (old_src: `git archive HEAD src`, removed after the run) against
# this one, two rounds, one process each.
for r in 1 2; do
  for tree in benchmarks/results/2026-11-22-h100-host/old_src src; do
    echo "== round $r $tree"; PYTHONPATH=$tree python scripts/overhead.py 2>&1 | grep -v Warn
  done
done | tee $OUT/ab_host.txt
