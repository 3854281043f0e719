# SPDX-License-Identifier: Apache-2.0
"""The processes under test: pdproxy, engine-sim, and how they are started,
checked and stopped.

* ``Proxy``: pdproxy as a subprocess on a free 127.0.0.1 port, started with
  explicit flags and a clean environment (no inherited OPENAI_API_KEY or
  PDPROXY_*), optionally behind a command prefix (``unshare ...``);
  readiness by polling connect(); stderr and stdout in files; stopped with
  SIGINT (SIGKILL after 2 s).
* ``start_pdproxy``: the one start loop: a free port, spawn, wait until
  ready, check that no other process shares the port (pdproxy listens with
  SO_REUSEPORT), again on another port when the first was taken meanwhile.
* ``run_pdproxy``: pdproxy run to completion (--help, bad flags).
* ``Proc``, ``start_proc``, ``start_engine_sim``, ``start_sim_proxy``:
  engine-sim and pdproxy for the end-to-end tests and the benchmarks, output
  in one log, ready when a GET answers 200, stopped with SIGTERM.
* ``sanitized`` / ``slack`` and ``SANITIZER_RE``: sanitizer builds and what
  they report.

Every loop is bounded by a deadline and an iteration count."""

import os
import re
import signal
import subprocess
import tempfile

from pdharness.net import HOST, free_port, listening_inodes, now, port_accepts, socket_inodes, \
    wait_http, wait_until

BIN_DIR = os.environ.get("PX_BIN_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "build", "bin")
PDPROXY = os.path.join(BIN_DIR, "pdproxy")
ENGINE_SIM = os.path.join(BIN_DIR, "engine-sim")


def read_text(path):
    """A log file's text ("" when it is gone)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def sanitized(pid):
    """Whether process `pid` runs with AddressSanitizer."""
    try:
        with open("/proc/%d/maps" % pid) as f:
            return "libasan" in f.read()
    except OSError:
        return False


def rss_bytes(pid):
    """Resident set size of process `pid` in bytes (0 when unknown)."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def slack(pid):
    """How much longer than usual a bound on a latency may be for process
    `pid`: three times under AddressSanitizer, which slows every request
    and runs beside other tests. The bounds are there to catch a hang or a
    stall behind other clients, not to measure speed."""
    return 3.0 if sanitized(pid) else 1.0


# --------------------------------------------------------------------------
# pdproxy subprocess


class ProxyStartError(Exception):
    pass


class Proxy:
    """pdproxy running as a subprocess. Use PxTestCase.start_proxy()."""

    def __init__(self, args, env=None, port=None, ready_timeout=5.0, log_dir=None, prefix=()):
        self.args = list(args)
        self.prefix = list(prefix)  # run as prefix + [pdproxy] + args (prefix execs pdproxy)
        self.port = port
        self.extra_env = dict(env or {})
        self.ready_timeout = ready_timeout
        self.proc = None
        self.ready_after = None  # seconds from spawn to first successful connect
        fd, self.stderr_path = tempfile.mkstemp(prefix="pdproxy-", suffix=".stderr", dir=log_dir)
        os.close(fd)
        self.stdout_path = self.stderr_path[:-len(".stderr")] + ".stdout"
        self._expected_exit = False

    @staticmethod
    def clean_env(extra=None):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("PDPROXY_") and k != "OPENAI_API_KEY"}
        env.update(extra or {})
        return env

    def spawn(self):
        cmd = self.prefix + [PDPROXY] + self.args
        with open(self.stderr_path, "wb") as err, open(self.stdout_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         env=self.clean_env(self.extra_env))
        self.t_spawn = now()
        return self

    def wait_ready(self):
        """Poll connect() until the port accepts, the process exits, or timeout."""
        def accepting():
            if self.proc.poll() is not None:
                raise ProxyStartError("pdproxy exited with %s before listening; stderr:\n%s"
                                      % (self.proc.returncode, self.stderr()))
            return port_accepts(self.port)

        if not wait_until(accepting, max(0.0, self.t_spawn + self.ready_timeout - now())):
            raise ProxyStartError("pdproxy not listening on %d after %.1fs; stderr:\n%s"
                                  % (self.port, self.ready_timeout, self.stderr()))
        self.ready_after = now() - self.t_spawn
        return self

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def owns_port(self, timeout=1.0):
        """True when every socket listening on our port belongs to this pdproxy.

        pdproxy listens with SO_REUSEPORT, so a second process that picked the
        same "free" port (another test running in parallel) would silently
        share it and take some of our connections."""
        def check():
            listeners = listening_inodes(self.port)
            mine = socket_inodes(self.proc.pid)
            return bool(listeners) and bool(listeners & mine) and listeners <= mine
        return bool(wait_until(check, timeout, 0.01))

    def stderr(self):
        return read_text(self.stderr_path)

    def stdout(self):
        return read_text(self.stdout_path)

    def stop(self):
        """Stop (SIGINT, then SIGKILL after 2 s) and reap. Returns the exit status.

        SIGINT, not SIGTERM: pdproxy answers SIGTERM with a graceful drain
        (a drain delay for load balancers, then in-flight requests), SIGINT
        with an immediate clean exit, which still lets sanitizers report."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGINT)
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5.0)
        return self.proc.returncode

    def remove_logs(self):
        for p in (self.stderr_path, self.stdout_path):
            try:
                os.unlink(p)
            except OSError:
                pass



def start_pdproxy(make_args, track, env=None, ready_timeout=5.0, prefix=(), tries=3,
                  make_env=None):
    """pdproxy listening on a free port: make_args(port) gives its flags (and
    make_env(port), when given, environment variables added to `env`);
    track(proxy) is called for every process spawned, before it is known to
    be ready, so that the caller stops each one. Another port when pdproxy
    found its port in use or shared with another process (SO_REUSEPORT)."""
    last = None
    for _ in range(tries):
        port = free_port()
        e = dict(env or {})
        e.update(make_env(port) if make_env is not None else {})
        p = Proxy(make_args(port), env=e, port=port, ready_timeout=ready_timeout,
                  prefix=prefix)
        p.spawn()
        track(p)
        try:
            p.wait_ready()
        except ProxyStartError as e:
            last = e
            if "in use" not in p.stderr().lower():
                raise
            continue
        if p.owns_port():
            return p
        last = ProxyStartError("port %d shared with another process" % port)
        p._expected_exit = True
        p.stop()
    raise last


def run_pdproxy(args, env=None, timeout=5.0):
    """Run pdproxy to completion (for --help, --version, bad flags).
    Returns CompletedProcess with text stdout/stderr; raises on timeout."""
    p = subprocess.run([PDPROXY] + list(args), stdin=subprocess.DEVNULL, capture_output=True,
                       env=Proxy.clean_env(env), timeout=timeout)
    p.stdout = p.stdout.decode("utf-8", "replace")
    p.stderr = p.stderr.decode("utf-8", "replace")
    return p



# What AddressSanitizer, LeakSanitizer and UBSan print when they find something.
SANITIZER_RE = re.compile(r"ERROR: (Address|Leak|Thread|Memory)Sanitizer[^\n]*|"
                          r"[^\n]*runtime error:[^\n]*")

# A log line at warning level: "warn", "WARN", "warning", "level=warn", "W ".
WARN_RE = re.compile(r"(?i)\bwarn(ing)?\b")


# --------------------------------------------------------------------------
# engine-sim and pdproxy for the end-to-end tests


class Proc:
    """A child process with its stdout and stderr in one file; stop() reaps it."""

    def __init__(self, name, argv, env=None):
        self.name = name
        fd, self.log_path = tempfile.mkstemp(prefix=name + "-", suffix=".log")
        os.close(fd)
        e = dict(os.environ)
        e.setdefault("UCX_TLS", "tcp,self")
        e.update(env or {})
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=e)

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self, timeout=10):
        """SIGTERM and wait; returns the exit status (SIGKILL after timeout)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_proc(name, argv_for, health, env=None, timeout=15.0, track=None):
    """A Proc on a free port (argv_for(port); p.port), once GET `health`
    answers 200; track(p), when given, is called before the wait, so that
    the caller stops it either way.

    free_port() only says the port was free a moment ago: another test
    running beside this one, or the child's own ephemeral sockets (UCX's
    tcp listeners open before the HTTP port is bound), may take it first.
    A child that exits because its port is in use is started again on a
    new port, at most 5 times."""
    for attempt in range(5):
        port = free_port()
        p = Proc("%s-%d" % (name, port), argv_for(port), env=env)
        p.port = port
        if track is not None:
            track(p)
        try:
            wait_http(port, health, timeout=timeout, proc=p)
            return p
        except RuntimeError:
            if attempt == 4 or p.alive() or "address already in use" not in p.log().lower():
                raise


def start_engine_sim(role, extra=(), env=None, port=None):
    """engine-sim in `role` (prefill, decode, both) with small KV blocks; on
    `port` when given (an engine restarted where it was), else a free one."""
    def argv(p):
        return [ENGINE_SIM, "--role", role, "--port", str(p), "--num-blocks", "4096",
                "--layers", "2", "--block-bytes", "4096"] + list(extra)
    if port is None:
        return start_proc("engine-sim-%s" % role, argv, "/health", env=env)
    p = Proc("engine-sim-%s-%d" % (role, port), argv(port), env=env)
    p.port = port
    try:
        wait_http(port, "/health", timeout=15.0, proc=p)
    except RuntimeError:
        p.kill()
        raise
    return p


def start_sim_proxy(prefills, decodes, extra=()):
    """pdproxy in front of engine-sim ports `prefills` and `decodes`."""
    def argv(port):
        return [PDPROXY, "--port", str(port), "--threads", "2", "--drain-delay", "0",
                "--prefiller-hosts"] + [HOST] * len(prefills) + ["--prefiller-ports"] + \
            [str(p) for p in prefills] + ["--decoder-hosts"] + [HOST] * len(decodes) + \
            ["--decoder-ports"] + [str(d) for d in decodes] + list(extra)
    return start_proc("pdproxy", argv, "/healthcheck")
