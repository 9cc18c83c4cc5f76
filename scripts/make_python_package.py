#!/usr/bin/env python3
"""Stages the Python package of a build and writes its wheel.

  scripts/make_python_package.py BUILD_DIR

BUILD_DIR/python/moekit: python/moekit's sources (symlinked, so that edits show without a rebuild) and
_lib/ with libmoekit_c.so and the shared libraries it needs that a machine with torch may lack (oneDNN,
the OpenCL loader), found through the library's $ORIGIN run path.
BUILD_DIR/dist/moekit-VERSION-py3-none-linux_x86_64.whl: the same files, copied.

The wheel is written here with the standard library rather than by setuptools because it holds no
extension to compile: the package loads libmoekit_c.so through ctypes, so one wheel (tag py3-none) serves
every CPython 3 and every torch. Its files are written in sorted order with fixed timestamps, so the same
build gives the same wheel.
"""
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = os.path.join(ROOT, "python", "moekit")
# What ldd resolves that is bundled: libraries the GPU machine and a plain torch install do not have.
BUNDLED = re.compile(r"lib(dnnl|OpenCL)\.so[.0-9]*$")
TIMESTAMP = (2026, 1, 1, 0, 0, 0)


def version():
    text = open(os.path.join(SOURCES, "_version.py")).read()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def bundled_libraries(library):
    out = subprocess.run(["ldd", library], check=True, capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split("=>")
        if len(parts) == 2 and BUNDLED.search(parts[0].strip()):
            path = parts[1].split("(")[0].strip()
            if not os.path.exists(path):
                sys.exit(f"make_python_package: {parts[0].strip()} needed by {library} was not found")
            found.append((parts[0].strip(), os.path.realpath(path)))
    return found


def stage(build_dir):
    library = os.path.join(build_dir, "libmoekit_c.so")
    if not os.path.exists(library):
        sys.exit(f"make_python_package: {library} not found (build the moekit_c target first)")
    package = os.path.join(build_dir, "python", "moekit")
    shutil.rmtree(package, ignore_errors=True)
    os.makedirs(os.path.join(package, "_lib"))
    for name in sorted(os.listdir(SOURCES)):
        if name.endswith(".py"):
            os.symlink(os.path.join(SOURCES, name), os.path.join(package, name))
    shutil.copy2(library, os.path.join(package, "_lib", "libmoekit_c.so"))
    for soname, path in bundled_libraries(library):
        shutil.copy2(path, os.path.join(package, "_lib", soname))
    return package


def record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def write_wheel(package, build_dir):
    v = version()
    dist_info = f"moekit-{v}.dist-info"
    files = []
    for folder, folders, names in os.walk(package):
        folders[:] = [f for f in folders if f != "__pycache__"]
        for name in names:
            path = os.path.join(folder, name)
            files.append((os.path.relpath(path, os.path.dirname(package)), path))
    files.sort()
    metadata = (
        "Metadata-Version: 2.1\n"
        "Name: moekit\n"
        f"Version: {v}\n"
        "Summary: Mixture-of-Experts expert layers: interchangeable backends for PyTorch and transformers\n"
        "Requires-Python: >=3.9\n"
    )
    wheel = "Wheel-Version: 1.0\nGenerator: moekit make_python_package.py\nRoot-Is-Purelib: false\nTag: py3-none-linux_x86_64\n"
    dist = os.path.join(build_dir, "dist")
    os.makedirs(dist, exist_ok=True)
    target = os.path.join(dist, f"moekit-{v}-py3-none-linux_x86_64.whl")
    records = []
    with zipfile.ZipFile(target + ".part", "w", zipfile.ZIP_DEFLATED) as z:

        def add(arcname, data, executable=False):
            info = zipfile.ZipInfo(arcname, TIMESTAMP)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = (0o755 if executable else 0o644) << 16
            z.writestr(info, data)
            records.append(record_line(arcname, data))

        for arcname, path in files:
            with open(path, "rb") as f:
                add(arcname, f.read(), executable=arcname.endswith(".so") or ".so." in arcname)
        add(f"{dist_info}/METADATA", metadata.encode())
        add(f"{dist_info}/WHEEL", wheel.encode())
        records.append(f"{dist_info}/RECORD,,")
        info = zipfile.ZipInfo(f"{dist_info}/RECORD", TIMESTAMP)
        z.writestr(info, ("\n".join(records) + "\n").encode())
    os.replace(target + ".part", target)
    return target


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build_dir = os.path.abspath(sys.argv[1])
    package = stage(build_dir)
    target = write_wheel(package, build_dir)
    print(f"python package: {package}\nwheel: {target} ({os.path.getsize(target) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
