"""Summarize `ncu --page source --csv --print-source sass` output per kernel (run it where the
report is: the CSV of a large kernel is tens of MB).

    python3 benchmarks/profiling/ncu_sass_summary.py FILE.csv [--top 40]

Per kernel: instructions executed by opcode class (what the kernel spends its issue slots on),
local-memory (spill) instructions, stall samples by reason, and the instructions with the most
stall samples (with their neighbours' opcodes, to place them in the SASS).
"""

import argparse
import collections
import csv
import re


def kernels(path):
    name, header, rows = None, None, []
    with open(path, newline="") as fh:
        for rec in csv.reader(fh):
            if not rec:
                continue
            if rec[0] == "Kernel Name":
                if name is not None:
                    yield name, header, rows
                name, header, rows = rec[1], None, []
            elif rec[0] == "Address":
                header = rec
            elif header is not None:
                rows.append(dict(zip(header, rec)))
    if name is not None:
        yield name, header, rows


def num(x):
    try:
        return float(x)
    except ValueError:
        return 0.0


def opcode(src):
    s = src.strip()
    s = re.sub(r"^@!?U?P\w+\s+", "", s)
    return s.split(" ")[0] if s else "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--dump", help="also write PREFIX_<n>.tsv per kernel: index, executed, samples "
                    "(to join with a local nvdisasm --print-line-info of the same build)")
    args = ap.parse_args()
    for kn, (name, header, rows) in enumerate(kernels(args.csv)):
        if args.dump:
            with open(f"{args.dump}_{kn}.tsv", "w") as fh:
                fh.write(f"# {name}\n")
                for i, r in enumerate(rows):
                    ex, sm = num(r["Instructions Executed"]), num(r["Warp Stall Sampling (All Samples)"])
                    if ex or sm:
                        fh.write(f"{i}\t{ex:.0f}\t{sm:.0f}\n")
        print("=" * 100)
        print(name[:200])
        total_inst = sum(num(r["Instructions Executed"]) for r in rows)
        total_samp = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rows)
        print(f"instructions executed {total_inst:.3e}, stall samples {total_samp:.0f}, SASS lines {len(rows)}")
        by_op = collections.Counter()
        samp_op = collections.Counter()
        for r in rows:
            op = opcode(r["Source"]).split(".")[0]
            by_op[op] += num(r["Instructions Executed"])
            samp_op[op] += num(r["Warp Stall Sampling (All Samples)"])
        print("opcode: % of instructions executed, % of stall samples")
        for op, n in by_op.most_common(30):
            print(f"  {op:12} {100 * n / max(total_inst, 1):6.2f}%  {100 * samp_op[op] / max(total_samp, 1):6.2f}%")
        reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        tot = {h: sum(num(r[h]) for r in rows) for h in reasons}
        print("stall reasons (% of samples):",
              ", ".join(f"{h[6:]} {100 * v / max(total_samp, 1):.1f}" for h, v in sorted(tot.items(), key=lambda kv: -kv[1]) if v))
        ranked = sorted(range(len(rows)), key=lambda i: -num(rows[i]["Warp Stall Sampling (All Samples)"]))
        print(f"top {args.top} instructions by stall samples (idx, samples, executed, top reasons, source):")
        for i in ranked[: args.top]:
            r = rows[i]
            rs = sorted(((num(r[h]), h[6:]) for h in reasons), reverse=True)[:2]
            print(f"  {i:5d} {num(r['Warp Stall Sampling (All Samples)']):7.0f} {num(r['Instructions Executed']):9.0f} "
                  f"{','.join(f'{h}:{v:.0f}' for v, h in rs if v):28} {r['Source'].strip()[:90]}")


if __name__ == "__main__":
    main()
