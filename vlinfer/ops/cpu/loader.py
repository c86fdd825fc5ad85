"""The CPU kernels' loader: where the C++ sources live (csrc/), the compiler flags per
instruction-set level (cpu_features.CPU_ISAS), and the builds with torch's extension builder, one
extension per level. Explicit -m flags rather than -march=native: a build must not depend on the
machine that compiles it, only on the level asked for."""
import glob
import hashlib
import os

# Inside the package (package data, pyproject.toml), so an installed wheel builds the same kernels
# as a checkout.
CPU_KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
AVX512_FLAGS = AVX2_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
ISA_FLAGS = {"generic": (), "avx2": AVX2_FLAGS, "avx512": AVX512_FLAGS,
             "avx512bf16": AVX512_FLAGS + ("-mavx512bf16", "-mavx512vnni")}
SOURCES = tuple(
    os.path.join(CPU_KERNEL_DIR, name)
    for name in ("paged_ops.cpp", "attention_bf16.cpp", "moe_experts.cpp", "panel_linear.cpp",
                 "decode_layer.cpp", "kv_quant.cpp", "lora_panels.cpp",
                 "linear_attention.cpp", "linear_attention_prefill.cpp", "int8_vnni.cpp"))


def build_extension(isa: str):
    """Compile (first time for this level on this machine) and import the kernels for one
    instruction-set level."""
    from torch.utils.cpp_extension import load as load_extension
    sources = list(SOURCES)
    for source in sources:
        if not os.path.exists(source):
            raise FileNotFoundError(
                f"kernel source {source} is missing (the package was built without its data)")
    # torch keys its build cache by the sources' contents and the flags, not by the headers they
    # include: a digest of the headers in the flags makes a changed header rebuild too.
    headers = sorted(glob.glob(os.path.join(CPU_KERNEL_DIR, "*.h")))
    digest = hashlib.sha256(b"".join(open(h, "rb").read() for h in headers)).hexdigest()[:16]
    flags = [
        "-O3", "-fopenmp", "-ffast-math", *ISA_FLAGS[isa], f"-DVLINFER_HEADERS_DIGEST={digest}"
    ]
    return load_extension(f"vlinfer_cpu_kernels_{isa}", sources, extra_cflags=flags,
                          extra_ldflags=["-fopenmp"], verbose=False)
