# SPDX-License-Identifier: Apache-2.0
"""The build backend of the pdkv package (PEP 517, in-tree: pyproject.toml
names it with backend-path), so that `pip install ./connector/python` needs
nothing but pip: no setuptools, no wheel package, no index.  The package is
pure Python (a ctypes binding), so a wheel is a zip of pdkv/ and its
metadata; a libkvconnector.so placed in pdkv/ is shipped beside the code.

Implements build_wheel, build_sdist, build_editable (a .pth file pointing at
this folder) and their get_requires_* / prepare_metadata_* hooks."""
import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "pdkv"


def _project():
    """name, version, summary, requires-python, license from pyproject.toml."""
    with open(os.path.join(HERE, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    try:
        import tomllib
        p = tomllib.loads(text)["project"]
        lic = p.get("license", {})
        return (p["name"], p["version"], p.get("description", ""),
                p.get("requires-python", ""), lic.get("text", "") if isinstance(lic, dict) else "")
    except ImportError:  # Python before 3.11: the few plain keys this file uses
        def key(k):
            m = re.search(r'^%s\s*=\s*"([^"]*)"' % re.escape(k), text, re.M)
            return m.group(1) if m else ""
        lic = re.search(r'^license\s*=\s*\{\s*text\s*=\s*"([^"]*)"', text, re.M)
        return (key("name"), key("version"), key("description"), key("requires-python"),
                lic.group(1) if lic else "")


def _dist():
    name, version, *_ = _project()
    return re.sub(r"[-_.]+", "_", name), version


def _metadata():
    name, version, summary, requires, lic = _project()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    if summary:
        lines.append(f"Summary: {summary}")
    if lic:
        lines.append(f"License: {lic}")
    if requires:
        lines.append(f"Requires-Python: {requires}")
    return "\n".join(lines) + "\n"


def _files():
    """(path in the archive, path on disk) of the package."""
    root = os.path.join(HERE, PKG)
    for f in sorted(os.listdir(root)):
        if f.endswith(".py") or f == "py.typed" or re.match(r"libkvconnector\.so(\.\d+)*$", f):
            yield f"{PKG}/{f}", os.path.join(root, f)


def _write_wheel(directory, entries):
    dist, version = _dist()
    info = f"{dist}-{version}.dist-info"
    name = f"{dist}-{version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(os.path.join(directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        def add(arc, data):
            z.writestr(zipfile.ZipInfo(arc, (1980, 1, 1, 0, 0, 0)), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{arc},sha256={digest.decode()},{len(data)}")
        for arc, data in entries:
            add(arc, data)
        add(f"{info}/METADATA", _metadata().encode())
        add(f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: pdkv_build\n"
                             b"Root-Is-Purelib: true\nTag: py3-none-any\n")
        record.append(f"{info}/RECORD,,")
        z.writestr(zipfile.ZipInfo(f"{info}/RECORD", (1980, 1, 1, 0, 0, 0)),
                   "\n".join(record) + "\n")
    return name


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    dist, version = _dist()
    info = f"{dist}-{version}.dist-info"
    os.makedirs(os.path.join(metadata_directory, info), exist_ok=True)
    with open(os.path.join(metadata_directory, info, "METADATA"), "w") as f:
        f.write(_metadata())
    return info


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, [(a, _read(p)) for a, p in _files()])


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(wheel_directory, [(f"_{PKG}_editable.pth", (HERE + "\n").encode())])


def build_sdist(sdist_directory, config_settings=None):
    dist, version = _dist()
    base = f"{dist}-{version}"
    name = f"{base}.tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as t:
        def add(arc, data):
            ti = tarfile.TarInfo(f"{base}/{arc}")
            ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
            t.addfile(ti, io.BytesIO(data))
        for arc, path in _files():
            add(arc, _read(path))
        for extra in ("pyproject.toml", "_build/pdkv_build.py"):
            add(extra, _read(os.path.join(HERE, extra)))
        add("PKG-INFO", _metadata().encode())
    return name
