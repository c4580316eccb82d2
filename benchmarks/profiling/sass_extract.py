"""Pull the sm_90a cubin (ELF, machine 190) out of an nvcc object file (its uncompressed fatbin),
so that nvdisasm can read it where cuobjdump is not installed.

    python3 benchmarks/profiling/sass_extract.py OBJ.o OUT.cubin
"""

import struct
import sys


def main() -> None:
    data = open(sys.argv[1], "rb").read()
    for i in range(1, len(data) - 64):
        if data.startswith(b"\x7fELF", i) and struct.unpack_from("<H", data, i + 18)[0] == 190:
            # ELF64: the image ends with the section or the program header table, whichever is last
            phoff, shoff = struct.unpack_from("<QQ", data, i + 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, i + 54)
            size = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
            open(sys.argv[2], "wb").write(data[i:i + size])
            print(f"cubin at {i}, {size} bytes")
            return
    sys.exit("no uncompressed sm_xx cubin in " + sys.argv[1])


if __name__ == "__main__":
    main()
