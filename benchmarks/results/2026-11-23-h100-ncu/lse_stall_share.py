"""Share of the warp-stall samples on the `FMUL x, lse, log2(e)` instructions (lse scaled to base 2 where
it is loaded) per kernel, from gzipped `ncu -i REP --page source --print-source sass --csv` files; the
NOPs where the three unused warps of the loader's warpgroup wait (a quarter of the samples) left out
in the last column. python3 lse_stall_share.py sass_*.csv.gz"""
import csv
import gzip
import sys


def kernels(path):
    """(kernel name, header, rows) per kernel of one file."""
    found, current = [], None
    for row in csv.reader(gzip.open(path, "rt")):
        if row and row[0] == "Kernel Name":
            current = [row[1], None, []]
            found.append(current)
        elif "Address" in row:
            current[1] = row
        elif current and current[1] and len(row) == len(current[1]):
            current[2].append(row)
    return found


if __name__ == "__main__":
    for path in sys.argv[1:]:
        for name, header, body in kernels(path):
            samples, source = header.index("Warp Stall Sampling (All Samples)"), header.index("Source")
            total = sum(float(r[samples]) for r in body)
            nop = sum(float(r[samples]) for r in body if r[source].strip() == "NOP")
            lse = sum(float(r[samples]) for r in body if "FMUL" in r[source] and "1.4426950216293334961" in r[source])
            print(f"{path.split('/')[-1]:28s} {name:24s} samples {total:8.0f}  NOP {nop / total:5.1%}  "
                  f"FMUL*log2e {lse / total:5.1%}, of the rest {lse / (total - nop):5.1%}")
