"""Per-source-line totals of one kernel's ncu per-instruction counts (the --dump of
ncu_sass_summary.py, taken on the GPU machine) joined with this machine's disassembly of the same
build (the instruction order is the same when the object files are the same).

    python3 benchmarks/profiling/sass_extract.py build/.../bwd_bf16_hd128.cu.o /tmp/bwd.cubin
    python3 benchmarks/profiling/sass_lines.py /tmp/bwd.cubin 'bwd_kernel_sm90.*Lb1ELb0E' dump_1.tsv [--top 40]
"""

import argparse
import collections
import re
import subprocess

NVDISASM = "nvdisasm"


def sass_with_lines(cubin, kernel_regex, nvdisasm):
    text = subprocess.run([nvdisasm, "-g", "-c", cubin], capture_output=True, text=True, check=True).stdout
    out, cur, inside = [], "?", False
    for line in text.split("\n"):
        if line.startswith(".text."):
            inside = re.search(kernel_regex, line) is not None
            continue
        if not inside:
            continue
        if line.startswith("//-----"):
            break
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            cur = m.group(1).split("/")[-1] + ":" + m.group(2)
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((cur, m.group(2).strip()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cubin")
    ap.add_argument("kernel_regex")
    ap.add_argument("dump")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--nvdisasm", default=NVDISASM)
    args = ap.parse_args()
    sass = sass_with_lines(args.cubin, args.kernel_regex, args.nvdisasm)
    ex, sm = collections.Counter(), collections.Counter()
    total_ex = total_sm = 0.0
    for line in open(args.dump):
        if line.startswith("#"):
            print(line.strip()[:160], f"(SASS here: {len(sass)} instructions)")
            continue
        i, e, s = line.split()
        i, e, s = int(i), float(e), float(s)
        src = sass[i][0] if i < len(sass) else "?"
        ex[src] += e
        sm[src] += s
        total_ex += e
        total_sm += s
    print(f"{'source line':40} {'% executed':>10} {'% stalls':>9}")
    for src, e in ex.most_common(args.top):
        print(f"{src:40} {100 * e / total_ex:10.2f} {100 * sm[src] / max(total_sm, 1):9.2f}")
    print("by stall samples:")
    for src, s in sm.most_common(args.top // 2):
        print(f"{src:40} {100 * ex[src] / total_ex:10.2f} {100 * s / max(total_sm, 1):9.2f}")


if __name__ == "__main__":
    main()
