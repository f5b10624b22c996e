"""Build-stage helper of the Containerfile: makes the image's final root file system small.

    python3 slim.py strip VENV          strip the extension modules' debug symbols; drop what only a
                                        compiler or a type checker reads (.pyi, .pyx, .pxd, .h, .c)
    python3 slim.py precompile VENV     byte-compile what the entry points import, nothing else
    python3 slim.py rootfs OUT VENV     copy what the image runs into OUT (a FROM scratch stage takes it)

`rootfs` keeps the system Python (its executable, the standard library without test suites, IDLE,
tkinter, lib2to3, ensurepip), the shared libraries that Python, its extension modules, the
virtual environment's extension modules and a few shell tools load (ldd's closure, plus glibc's
name-service modules, which are dlopen()ed), /etc, the CA certificates and the virtual environment.
No package manager, perl, locales, iconv modules or documentation. It works from any Debian-like
base: a debootstrap root (Python in /usr) or the official python:*-slim images (Python in
/usr/local).
"""

from __future__ import annotations

import importlib
import os
import py_compile
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

# standard-library parts no server imports
STDLIB_DROP = {"test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "pydoc_data",
               "site-packages", "dist-packages", "turtle.py"}
# extension modules of the standard library nothing here loads (CPython's own test modules, NIS,
# dbm, curses, readline, OSS audio): with them go the libraries they link (Berkeley DB, Kerberos...)
DYNLOAD_DROP = ("_test", "_ctypes_test", "_xxtestfuzz", "xxlimited", "nis.", "_dbm.", "_gdbm.", "_curses",
                "readline.", "ossaudiodev.")
# files no import reads
BUILD_ONLY = {".pyi", ".pyx", ".pxd", ".pxi", ".h", ".c", ".cpp"}
# a merged /usr's top-level links (/bin -> usr/bin): scripts ask for /bin/sh
TOP_LINKS = ["/bin", "/sbin", "/lib", "/lib64"]
# a shell and the tools `podman exec` users reach for first
TOOLS = ["sh", "bash", "env", "id", "ls", "cat", "echo", "sleep", "true", "false", "mkdir", "rm", "cp",
         "mv", "ln", "head", "tail", "grep", "touch", "pwd", "uname", "date", "readlink", "wc", "kill"]
# loaded with dlopen(), so ldd does not list them: host and user look-ups (getaddrinfo, getpwuid)
DLOPENED = ["libnss_files.so.2", "libnss_dns.so.2", "libresolv.so.2"]
# what the entry points import while starting (serve's warm-up imports some inside functions)
ENTRY_MODULES = [
    "vllm_vcr.cli", "vllm_vcr.logging_setup", "vllm_vcr.deploy.entrypoint", "vllm_vcr.deploy.healthcheck",
    "vllm_vcr.serve.cli", "vllm_vcr.serve.server", "vllm_vcr.serve.app", "vllm_vcr.serve.warmup",
    "vllm_vcr.serve.config_file", "vllm_vcr.serve.extension_args", "vllm_vcr.serve.help",
    "vllm_vcr.vllm.http_metrics", "vllm_vcr.wire.cli", "vllm_vcr.pd.cli", "vllm_vcr.fleet.cli",
    "uvloop", "jsonschema", "starlette.middleware.cors", "encodings.idna", "difflib",
]


def site_packages(venv: Path) -> Path:
    (sp,) = venv.glob("lib/python3*/site-packages")
    return sp


def is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def cmd_strip(venv: Path) -> None:
    """--strip-unneeded on the extension modules. Not on the libraries auditwheel grafted into
    `<pkg>.libs/`: patchelf rewrote their headers, and strip then leaves them unloadable."""
    for p in site_packages(venv).rglob("*"):
        if p.suffix in BUILD_ONLY and p.is_file() and ".dist-info" not in p.parent.name:
            p.unlink()
    if shutil.which("strip") is None:
        print("slim.py: no strip here (binutils): extension modules keep their symbols", file=sys.stderr)
        return
    files = [p for p in site_packages(venv).rglob("*.so*")
             if p.is_file() and not p.is_symlink() and not any(part.endswith(".libs") for part in p.parts)
             and is_elf(p)]
    for i in range(0, len(files), 100):
        subprocess.run(["strip", "--strip-unneeded", *map(str, files[i:i + 100])], check=True)


def cmd_precompile(venv: Path) -> None:
    """Byte-code for vllm_vcr and for every module the entry points import; the rest of the
    dependencies (rarely used corners of large packages) stays source only and compiles in memory
    if ever imported. Checked-hash .pyc files: valid whatever the files' times after copying."""
    sp = site_packages(venv)
    sys.path.insert(0, str(sp))
    for name in ENTRY_MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an optional piece missing only costs its byte-code
            print(f"slim.py: precompile: {name}: {type(e).__name__}: {e}", file=sys.stderr)
    files = {Path(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
    files |= set((sp / "vllm_vcr").rglob("*.py"))
    for f in sorted(files):
        if f.suffix == ".py" and sp in f.parents:
            py_compile.compile(str(f), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)


def ldd(paths: list[Path]) -> set[Path]:
    needed: set[Path] = set()
    for i in range(0, len(paths), 200):
        out = subprocess.run(["ldd", *map(str, paths[i:i + 200])], capture_output=True, text=True).stdout
        for m in re.finditer(r"(?:=>\s*)?(/\S+)\s+\(0x", out):
            needed.add(Path(m.group(1)))
        if "not found" in out:
            missing = sorted({line.split()[0] for line in out.splitlines() if "not found" in line})
            sys.exit(f"slim.py: libraries not found: {' '.join(missing)}")
    return needed


def canonical(path: Path) -> Path:
    """The path with every symlinked directory on the way resolved (/lib/x -> /usr/lib/x on a
    merged /usr), the last component kept as it is: tar then never writes through a link."""
    p = Path(os.path.abspath(path))
    return Path(os.path.realpath(p.parent)) / p.name


def with_links(path: Path) -> set[Path]:
    """The path, the symlinks on the way to its target (the directories' too) and the target."""
    out: set[Path] = set()
    p = Path(os.path.abspath(path))
    for _ in range(40):
        for parent in p.parents:  # a symlinked directory on the way (/lib -> usr/lib)
            if parent.is_symlink():
                out.add(canonical(parent))
        p = canonical(p)
        out.add(p)
        if not p.is_symlink():
            break
        p = Path(os.path.normpath(p.parent / os.readlink(p)))
    return out


def cmd_rootfs(out: Path, venv: Path) -> None:
    keep: set[Path] = set()
    trees: list[Path] = [Path("/etc"), venv]
    # the interpreter: python3 on PATH, its links, the standard library
    python = Path(shutil.which("python3") or sys.executable)
    keep |= with_links(python)
    for name in ("python", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        if (python.parent / name).exists():
            keep |= with_links(python.parent / name)
    stdlib = Path(sysconfig.get_path("stdlib"))
    for child in stdlib.iterdir():
        if child.name in STDLIB_DROP or child.name.startswith("config-"):
            continue
        if child.name == "lib-dynload":
            keep |= {m for m in child.iterdir() if not m.name.startswith(DYNLOAD_DROP)}
            continue
        if child.is_dir() and not child.is_symlink():
            trees.append(child)
        else:
            keep |= with_links(child)
    keep |= {canonical(Path(link)) for link in TOP_LINKS if os.path.islink(link)}
    for tool in TOOLS:
        if found := shutil.which(tool):
            keep |= with_links(Path(found))
    # CA certificates: /etc/ssl/certs links into /usr/share/ca-certificates; OpenSSL's directory
    for extra in ("/usr/share/ca-certificates", "/usr/lib/ssl"):
        if os.path.isdir(extra):
            trees.append(Path(extra))
    files: set[Path] = set(keep)
    for tree in trees:
        files |= with_links(tree)
        for root, dirs, names in os.walk(tree):
            for n in dirs + names:
                files.add(Path(root) / n)
    elves = [p for p in files if p.is_file() and not p.is_symlink() and is_elf(p)]
    libs = ldd(elves)
    libdir = next((p.parent for p in map(Path.resolve, libs) if p.name.startswith("libc.so")), None)
    if libdir is not None:
        libs |= {libdir / n for n in DLOPENED if (libdir / n).exists()}
    for lib in libs:
        files |= with_links(lib)
    files = {canonical(f) for f in files}
    # parent directories first, so that tar recreates them with their own modes
    listed: set[Path] = set()
    for f in list(files):
        for parent in f.parents:
            if parent != Path("/") and not parent.is_symlink():
                listed.add(parent)
        listed.add(f)
    entries = sorted(str(p).lstrip("/") for p in listed)
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["tar", "-C", "/", "--no-recursion", "-cf", "-", "-T", "-"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    extract = subprocess.Popen(["tar", "-C", str(out), "-xpf", "-"], stdin=archive.stdout)
    archive.stdout.close()
    archive.stdin.write("\n".join(entries).encode() + b"\n")
    archive.stdin.close()
    if archive.wait() or extract.wait():
        sys.exit("slim.py: copying the root file system failed")
    for d, mode in (("tmp", 0o1777), ("var/tmp", 0o1777), ("root", 0o700), ("proc", 0o555), ("sys", 0o555),
                    ("dev", 0o755), ("run", 0o755)):
        (out / d).mkdir(parents=True, exist_ok=True)
        os.chmod(out / d, mode)


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "strip":
        cmd_strip(Path(argv[1]))
    elif len(argv) >= 2 and argv[0] == "precompile":
        cmd_precompile(Path(argv[1]))
    elif len(argv) >= 3 and argv[0] == "rootfs":
        cmd_rootfs(Path(argv[1]), Path(argv[2]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
