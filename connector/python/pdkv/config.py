# SPDX-License-Identifier: Apache-2.0
"""PdkvConnector's settings and the checks on what it is told to connect to.

Settings come from the environment (PDKV_*) or kv_connector_extra_config
(docs/vllm-plugin.md lists them).  Three checks live here:

  side channel  rank r of data-parallel engine i listens on
                PDKV_SIDE_CHANNEL_PORT + i * tp_size + r, i being
                parallel_config.data_parallel_index (as NIXL offsets its
                port: vLLM resets data_parallel_rank to 0 in dense
                data-parallel engines, data_parallel_index it keeps).
  producers     kv_transfer_params come from requests, so remote_host and
                remote_port are checked before anything connects: a port is
                an int in 1..65535 (never wrapped into 16 bits), a host a
                name or address whose address lies in the allowed producer
                networks (allowed_producer_networks / PDKV_ALLOWED_PRODUCERS;
                default: loopback and the private ranges, see
                DEFAULT_PRODUCER_NETWORKS; "any" lifts the check).
  secret file   refused when group or others may read or write it (as ssh
                refuses a private key); read into a bytearray that is
                overwritten once the library has its copy.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import stat
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["ENV_HOST", "ENV_PORT", "ENV_SECRET_FILE", "ENV_ALLOWED", "DEFAULT_PORT",
           "DEFAULT_PRODUCER_NETWORKS", "ConfigError", "ParamsError", "SecretFileError",
           "Settings", "side_channel", "producer_networks", "check_remote", "resolve_allowed",
           "read_secret"]

ENV_HOST, ENV_PORT = "PDKV_SIDE_CHANNEL_HOST", "PDKV_SIDE_CHANNEL_PORT"
ENV_SECRET_FILE = "PDKV_SECRET_FILE"
ENV_ALLOWED = "PDKV_ALLOWED_PRODUCERS"
DEFAULT_PORT = 5610
# Where a cluster's engines live in practice: loopback, RFC 1918, the shared
# range some CNIs use (RFC 6598) and IPv6 unique-local.  Link-local
# (169.254.0.0/16: cloud metadata services) and public addresses are not in it.
DEFAULT_PRODUCER_NETWORKS = ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                             "100.64.0.0/10", "::1/128", "fc00::/7")
MAX_SECRET = 4096

Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]


class ConfigError(ValueError):
    """A setting of the connector is invalid (the engine does not start)."""


class ParamsError(ValueError):
    """kv_transfer_params a request carried are refused (nothing connects)."""


class SecretFileError(PermissionError):
    """The cluster secret's file is unsafe or unreadable."""


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ConfigError(f"pdkv: {what} {v!r} is not an integer") from None
    if not lo <= n <= hi:
        raise ConfigError(f"pdkv: {what} {n} is outside {lo}..{hi}")
    return n


def side_channel(vllm_config: Any, extra: Mapping[str, Any]) -> Tuple[str, int]:
    """(host, port of TP rank 0) of this engine's side channel."""
    host = os.environ.get(ENV_HOST) or extra.get("side_channel_host") or "127.0.0.1"
    base = _int(os.environ.get(ENV_PORT) or extra.get("side_channel_port") or DEFAULT_PORT,
                "side channel port", 1, 65535)
    pc = vllm_config.parallel_config
    dp = getattr(pc, "data_parallel_index", None)
    if dp is None:  # a vLLM before data_parallel_index
        dp = getattr(pc, "data_parallel_rank", 0)
    tp = int(pc.tensor_parallel_size)
    port = base + int(dp or 0) * tp
    if port + tp - 1 > 65535:
        raise ConfigError(f"pdkv: side channel ports {port}..{port + tp - 1} (base {base}, "
                          f"data-parallel index {dp}, TP {tp}) pass 65535")
    return str(host), port


def producer_networks(extra: Mapping[str, Any]) -> Optional[List[Network]]:
    """The allowed producer networks; None: any address."""
    raw = os.environ.get(ENV_ALLOWED)
    if raw is None:
        raw = extra.get("allowed_producer_networks", DEFAULT_PRODUCER_NETWORKS)
    items: Sequence[str] = raw.replace(",", " ").split() if isinstance(raw, str) else list(raw)
    if any(str(i).strip().lower() == "any" for i in items):
        return None
    nets = []
    for i in items:
        try:
            nets.append(ipaddress.ip_network(str(i).strip(), strict=False))
        except ValueError as e:
            raise ConfigError(f"pdkv: allowed producer network {i!r}: {e}") from None
    if not nets:
        raise ConfigError("pdkv: allowed_producer_networks is empty (\"any\" allows every "
                          "address)")
    return nets


def _allowed(addr: str, nets: Optional[Sequence[Network]]) -> bool:
    if nets is None:
        return True
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip.version == n.version and ip in n for n in nets)


def check_remote(params: Mapping[str, Any], nets: Optional[Sequence[Network]],
                 ranks: int = 1) -> Optional[str]:
    """Checks remote_host / remote_port of kv_transfer_params without any
    network access; raises ParamsError.  Returns the host's address when it
    is a literal address (allowed), None when it is a name (resolve_allowed
    checks it where a lookup may block).  ranks: how many side-channel ports
    from remote_port on the fetch may use (prefill TP size)."""
    port = params.get("remote_port")
    if isinstance(port, bool) or not isinstance(port, int):
        raise ParamsError(f"remote_port must be an integer, not {type(port).__name__}")
    if not 1 <= port <= 65535 - max(0, ranks - 1):
        raise ParamsError(f"remote_port {port} (with {ranks} rank(s)) is outside 1..65535")
    host = params.get("remote_host")
    if not isinstance(host, str):
        raise ParamsError(f"remote_host must be a string, not {type(host).__name__}")
    if not 0 < len(host) <= 253 or not host.isprintable() or any(c.isspace() for c in host):
        raise ParamsError("remote_host is not a host name or address")
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if not _allowed(host, nets):
        raise ParamsError(f"remote_host {host} is not in the allowed producer networks")
    return host


def resolve_allowed(host: str, nets: Optional[Sequence[Network]]) -> str:
    """The first address of host that lies in nets (a literal address is
    checked as it is); ParamsError if none does or the name does not
    resolve.  The address is what to connect to: the library does not look
    the name up again, so a second answer cannot lead elsewhere."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        addrs = [host]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError):
            raise ParamsError(f"remote_host {host!r} does not resolve") from None
        addrs = [str(i[4][0]) for i in infos]
    for a in addrs:
        if _allowed(a, nets):
            return a
    raise ParamsError(f"remote_host {host} is not in the allowed producer networks")


def read_secret(path: str) -> bytearray:
    """The cluster secret from path (one trailing newline stripped), as a
    bytearray the caller overwrites when done.  SecretFileError if the file
    is not a regular file, may be read or written by group or others (mode
    & 0o077, as ssh checks a private key), is empty or over 4096 bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SecretFileError(f"pdkv: secret file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)  # the file opened, not the name: no race with a swap
        if not stat.S_ISREG(st.st_mode):
            raise SecretFileError(f"pdkv: secret file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise SecretFileError(
                f"pdkv: secret file {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or "
                "others may access it; refused (chmod 600, or a Kubernetes secret volume "
                "with defaultMode 0400)")
        buf = bytearray(MAX_SECRET + 2)
        n = 0
        while n < len(buf):
            got = os.readv(fd, [memoryview(buf)[n:]])
            if got == 0:
                break
            n += got
    finally:
        os.close(fd)
    end = n
    if end and buf[end - 1] == 0x0A:
        end -= 1
        if end and buf[end - 1] == 0x0D:
            end -= 1
    if n > MAX_SECRET + 1 or end > MAX_SECRET or end == 0:
        buf[:] = bytes(len(buf))
        raise SecretFileError(f"pdkv: secret file {path} must hold 1..{MAX_SECRET} bytes")
    secret = bytearray(buf[:end])
    buf[:] = bytes(len(buf))
    return secret


@dataclasses.dataclass
class Settings:
    """Everything PdkvConnector reads from vLLM's config, checked once."""
    engine_id: str
    tp_size: int
    block_size: int
    use_mla: bool
    host: str
    base_port: int
    wait_ms: int
    lease_ms: int
    renew_s: float
    networks: Optional[List[Network]]
    secret_file: Optional[str]
    expiry_ms: Optional[int] = None
    xfer_timeout_ms: Optional[int] = None
    connect_timeout_ms: Optional[int] = None

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> "Settings":
        ktc = vllm_config.kv_transfer_config
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
        if pp > 1:
            raise ConfigError(f"pdkv: pipeline parallelism (size {pp}) is not supported")
        host, port = side_channel(vllm_config, extra)
        lease_ms = _int(extra.get("lease_ms", 30000), "lease_ms", 0, 2**32 - 1)

        def opt(name: str) -> Optional[int]:
            v = extra.get(name)
            return None if v is None else _int(v, name, 0, 2**32 - 1)
        return cls(engine_id=str(ktc.engine_id),
                   tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
                   block_size=int(vllm_config.cache_config.block_size),
                   use_mla=bool(getattr(vllm_config.model_config, "use_mla", False)),
                   host=host, base_port=port,
                   wait_ms=_int(extra.get("fetch_wait_ms", 30000), "fetch_wait_ms", 0,
                                2**32 - 1),
                   lease_ms=lease_ms,
                   renew_s=float(extra.get("lease_renew_s", lease_ms / 3000.0)),
                   networks=producer_networks(extra),
                   secret_file=os.environ.get(ENV_SECRET_FILE) or extra.get("secret_file"),
                   expiry_ms=opt("expiry_ms"), xfer_timeout_ms=opt("xfer_timeout_ms"),
                   connect_timeout_ms=opt("connect_timeout_ms"))
