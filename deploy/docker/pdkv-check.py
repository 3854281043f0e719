#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The pdkv image (deploy/k8s/components/pdkv/Dockerfile) checked without a
Docker engine, the way deploy/check.sh checks the proxy's image:

  1. every package its stages apt-get install is known to apt;
  2. every COPY source exists in the build context and .dockerignore keeps it;
  3. the build stage's cmake command configures and builds with nothing but
     the build stage's packages: the context is what the stage COPYs, and
     pkg-config sees only the .pc files of those packages and of what they
     depend on (a module CMake requires and the stage lacks fails here);
  4. the runtime stage's packages provide every shared library the built
     libkvconnector loads (runtime-libs.py), and it copies the library from
     where the build put it.

    pdkv-check.py DOCKERFILE WORK_DIR

The base is vLLM's image (Ubuntu): names are resolved with this machine's
apt (Debian), which shares them for every package listed.  Exits 1 after
printing every problem of the step that failed."""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def fail(msgs):
    for m in msgs:
        print("deploy/check: FAIL: pdkv image: " + m, file=sys.stderr)
    sys.exit(1)


def instructions(path):
    """(instruction, text) pairs, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in open(path):
        s = line.rstrip("\n")
        if not cur and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if s.lstrip().startswith("#"):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def expand(text, args):
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)),
                  text)


def stages(path):
    """[{name, args, apt: [pkg], copies: [(src..., dst, from)], runs: [cmd]}]"""
    glob_args, out = {}, []
    for ins, rest in instructions(path):
        if ins == "ARG":
            k, _, v = rest.partition("=")
            v = v.strip().strip('"')
            (out[-1]["args"] if out else glob_args)[k.strip()] = v
        elif ins == "FROM":
            words = rest.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(out))
            out.append({"name": name, "args": dict(glob_args), "apt": [], "copies": [],
                        "runs": [], "workdir": "/"})
        elif ins == "WORKDIR":
            out[-1]["workdir"] = rest
        elif ins == "COPY":
            words = rest.split()
            frm = None
            if words[0].startswith("--from="):
                frm = words.pop(0)[7:]
            out[-1]["copies"].append((words[:-1], words[-1], frm))
        elif ins == "RUN":
            cmd = expand(rest, out[-1]["args"])
            out[-1]["runs"].append(cmd)
            for seg in re.split(r"&&|;|\|\|", cmd):
                w = seg.split()
                if len(w) >= 2 and w[0] == "apt-get" and "install" in w:
                    out[-1]["apt"] += [p for p in w[w.index("install") + 1:]
                                       if not p.startswith("-")]
    return out


def dpkg_closure(roots):
    status = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package}\t${Provides}\t${Pre-Depends}, ${Depends}\n"],
        check=True, capture_output=True, text=True).stdout
    deps, provides = {}, {}
    for line in status.splitlines():
        name, prov, dep = (line.split("\t") + ["", ""])[:3]
        deps[name] = [re.split(r"[\s(:]", a.strip())[0] for d in dep.split(",") if d.strip()
                      for a in d.split("|")]
        for p in prov.split(","):
            p = re.split(r"[\s(]", p.strip())[0]
            if p:
                provides.setdefault(p, []).append(name)
    seen, todo = set(), list(roots)
    while todo:
        p = todo.pop()
        for real in ([p] if p in deps else provides.get(p, [])):
            if real not in seen:
                seen.add(real)
                todo.extend(deps[real])
    return seen


def main():
    dockerfile, work = sys.argv[1], sys.argv[2]
    st = stages(dockerfile)
    if len(st) < 2:
        fail(["expected a build stage and a runtime stage"])
    build, runtime = st[0], st[-1]

    # 1. package names
    errs = []
    for s in st:
        for p in s["apt"]:
            q = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True,
                               text=True)
            if "install ok installed" in q.stdout:
                continue
            if subprocess.run(["apt-cache", "show", p], capture_output=True).returncode:
                errs.append("stage %s installs %s, unknown to apt" % (s["name"], p))
    if errs:
        fail(errs)
    print("   build stage packages: %s" % " ".join(build["apt"]))
    print("   runtime stage packages: %s" % " ".join(runtime["apt"]))

    # 2. COPY sources, and the build context the build stage sees
    ignore = [ln.strip() for ln in open(os.path.join(ROOT, ".dockerignore"))
              if ln.strip() and not ln.startswith("#")]
    ctx = os.path.join(work, "context")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(ctx)
    for srcs, dst, frm in build["copies"]:
        if frm:
            continue
        for src in srcs:
            if not os.path.exists(os.path.join(ROOT, src)):
                errs.append("COPY source %s does not exist" % src)
                continue
            for pat in ignore:
                pat = pat.rstrip("/")
                if src != "." and (src == pat or src.startswith(pat + "/")):
                    errs.append(".dockerignore pattern %s excludes COPY source %s" % (pat, src))
            if dst.startswith("/"):
                continue  # outside WORKDIR: tools, not sources
            s_path = os.path.join(ROOT, src)
            d_path = ctx if dst in (".", "./") else os.path.join(ctx, dst.rstrip("/"))
            if os.path.isdir(s_path):  # its contents go into dst
                shutil.copytree(s_path, d_path, dirs_exist_ok=True, symlinks=True,
                                ignore=shutil.ignore_patterns("build*", ".git", "node_modules",
                                                              "__pycache__", "*.pyc"))
            else:
                if dst in (".", "./") or dst.endswith("/"):
                    d_path = os.path.join(d_path, os.path.basename(src))
                os.makedirs(os.path.dirname(d_path), exist_ok=True)
                shutil.copy(s_path, d_path)
    if errs:
        fail(errs)

    # 3. configure and build with the build stage's packages only
    cmake = [r for r in build["runs"] if re.search(r"\bcmake -S\b", r)]
    if not cmake:
        fail(["the build stage runs no 'cmake -S'"])
    seg = next(x for x in re.split(r"&&|;", cmake[0]) if "cmake -S" in x)
    words = shlex.split(seg)
    flags = [w for w in words if w.startswith("-D")]
    bdir = words[words.index("-B") + 1] if "-B" in words else None
    cuda_inc = "/usr/local/cuda/include"
    flags2 = []
    for f in flags:
        if "$" in f:  # computed in the image (the CUDA headers' directory)
            k = f[2:].split("=")[0]
            if k == "KVC_CUDA_INCLUDE_DIR" and os.path.exists(cuda_inc + "/cuda_runtime_api.h"):
                flags2.append("-DKVC_CUDA_INCLUDE_DIR=" + cuda_inc)
            elif k == "KVC_CUDA_INCLUDE_DIR":
                flags2 = [x for x in flags2 if not x.startswith("-DPDPROXY_WITH_CUDA")]
                flags2.append("-DPDPROXY_WITH_CUDA=OFF")
            continue
        flags2.append(f)
    pcdir = os.path.join(work, "pkgconfig")
    os.makedirs(pcdir)
    closure = dpkg_closure(build["apt"] + ["libc6-dev"])
    npc = 0
    for p in sorted(closure):
        q = subprocess.run(["dpkg", "-L", p], capture_output=True, text=True)
        for f in q.stdout.splitlines():
            if f.endswith(".pc") and os.path.isfile(f):
                dst = os.path.join(pcdir, os.path.basename(f))
                if not os.path.exists(dst):
                    os.symlink(f, dst)
                    npc += 1
    env = dict(os.environ, PKG_CONFIG_LIBDIR=pcdir, PKG_CONFIG_PATH="")
    bld = os.path.join(work, "build")
    cfg = ["cmake", "-S", ctx, "-B", bld] + flags2
    print("   cmake %s (pkg-config: %d .pc files of the build stage's packages)"
          % (" ".join(flags2), npc))
    r = subprocess.run(cfg, env=env, capture_output=True, text=True, timeout=300)
    if r.returncode:
        tail = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-15:]
        fail(["the build stage's cmake configure fails with its packages:"] + tail)
    target = [w for w in shlex.split(cmake[0]) if w]
    tgt = target[target.index("--target") + 1] if "--target" in target else "kvconnector"
    r = subprocess.run(["cmake", "--build", bld, "-j", os.environ.get("JOBS", "2"), "--target",
                        tgt], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode:
        tail = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-15:]
        fail(["the build stage's build fails:"] + tail)
    libs = glob.glob(os.path.join(bld, "connector", "libkvconnector.so.*.*"))
    if not libs:
        fail(["no libkvconnector.so built"])

    # 4. the runtime stage copies it from there, and has its libraries
    copies = [c for c in runtime["copies"] if c[2] == build["name"]]
    want = "%s/connector/libkvconnector.so" % (bdir or "")
    if not any(any(s.startswith(want) for s in c[0]) for c in copies):
        fail(["the runtime stage does not COPY --from=%s %s*" % (build["name"], want)])
    ldd = os.path.join(work, "ldd.libkvconnector")
    with open(ldd, "w") as f:
        subprocess.run(["ldd", libs[0]], stdout=f, check=True)
    if "not found" in open(ldd).read():
        fail(["libkvconnector: a shared library not found:", open(ldd).read()])
    r = subprocess.run([sys.executable, os.path.join(HERE, "runtime-libs.py"),
                        " ".join(runtime["apt"]), ldd])
    if r.returncode:
        fail(["the runtime stage's packages do not provide every library libkvconnector loads"])
    needed = subprocess.run(["readelf", "-d", libs[0]], capture_output=True, text=True).stdout
    print("   libkvconnector NEEDED: %s" % " ".join(re.findall(r"\(NEEDED\).*\[(.+)\]", needed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
