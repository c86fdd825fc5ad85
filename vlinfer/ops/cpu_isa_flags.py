"""Where the C++ kernel sources live and the compiler flags per CPU instruction-set level (cpu_features.CPU_ISAS),
shared by every C++ kernel build (ops/cpu.py, ops/gguf_cpu.py). Explicit -m flags rather than -march=native: a build
must not depend on the machine that compiles it, only on the level asked for."""
import os

# Inside the package (package data, pyproject.toml), so an installed wheel builds the same kernels as a checkout.
CPU_KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "cpu")
AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
AVX512_FLAGS = AVX2_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
ISA_FLAGS = {"generic": (), "avx2": AVX2_FLAGS, "avx512": AVX512_FLAGS,
             "avx512bf16": AVX512_FLAGS + ("-mavx512bf16", "-mavx512vnni")}
