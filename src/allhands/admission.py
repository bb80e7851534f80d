"""Only processes holding the job's secret take part: the launcher's secret, the workers' proof.

torch's stores and process groups accept anyone who can connect (a stranger that took a rank
has been seen to change an all_reduce result). So right after ``init_process_group``, before any tensor of
the job is exchanged, every worker proves to every other that it holds the job secret, and a
worker that sees one bad proof refuses to go on (:func:`admit_peers`).

The proof travels over the process group itself, not the store: anyone can write the store, but
a stranger that took rank ``s`` can only be answered for in the collective. Two all-gathers:

1. every rank contributes 32 fresh random bytes; the transcript ``T = SHA-256(tag, world size,
   nonce_0 .. nonce_{n-1})`` is new for every job and every restart, so no proof seen on the wire
   before can be replayed;
2. every rank sends ``HMAC-SHA256(secret, T, rank, pid, address)`` with its pid and address,
   and checks every other rank's record against its own view of ``T``.

A stranger without the secret cannot make a valid proof for its rank, so every genuine rank
refuses it and raises :class:`AdmissionError` (one line naming the refused ranks and the
addresses they gave) before returning from ``Mesh.build``. The cost: two small all-gathers.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import sys
from collections.abc import Mapping
from typing import NoReturn

import torch
import torch.distributed as dist

from allhands.env import INSECURE_ENV, SECRET_ENV, SECRET_FILE_ENV, worker_admission_env
from allhands.errors import ConfigError, LaunchError
from allhands.safefs import read_owned_secret

MIN_SECRET_CHARS = 16

_TAG = b"allhands-admission-v1"
_NONCE = 32
_ADDR = 63
_RECORD = 32 + 8 + 1 + _ADDR  # proof | pid | address length | address (padded)


class AdmissionError(LaunchError):
    """A peer could not prove it holds the job secret, or this worker has none."""


# --------------------------------------------------------------------------- launcher side


def job_secret(*, multi_node: bool, secret_file: str, insecure: bool,
               env: Mapping[str, str]) -> str | None:
    """The secret the launcher gives its workers; ``None`` with ``insecure``.

    Single node: a fresh 256-bit secret, never written anywhere. Multi-node: from
    ``secret_file`` (``--secret-file``), else the file named by ALLHANDS_SECRET_FILE, else
    ALLHANDS_SECRET. Raises :class:`ConfigError` (exit 2) when a multi-node job has none.
    """
    if insecure:
        print("allhands: warning: --insecure: workers are not asked for the job secret, so any "
              "process that reaches the job's stores can take a rank and change its results",
              file=sys.stderr, flush=True)
        return None
    if not multi_node:
        return secrets.token_hex(32)
    path = secret_file or env.get(SECRET_FILE_ENV, "")
    if path:
        source = "--secret-file" if secret_file else SECRET_FILE_ENV
        return _checked(_read_secret_file(path, source), f"{source} {path}")
    if env.get(SECRET_ENV):
        return _checked(env[SECRET_ENV], SECRET_ENV)
    raise ConfigError(
        f"a multi-node job needs a secret shared by every node: set {SECRET_ENV}, or "
        f"{SECRET_FILE_ENV} / --secret-file to a file only you can read (e.g. `openssl rand -hex "
        f"32 > job.secret; chmod 600 job.secret`) on every node; or pass --insecure (not advised)")


def _read_secret_file(path: str, source: str) -> str:
    try:
        text = read_owned_secret(path)
    except FileNotFoundError:
        raise ConfigError(f"{source}: {path} does not exist; pass a file holding the job "
                          f"secret") from None
    except PermissionError as e:  # another user's file, or one others may read or write
        raise ConfigError(f"{source}: {e.args[0] if e.args and not e.filename else e.strerror}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{source}: cannot read {path} ({getattr(e, 'strerror', None) or e}); "
                          f"pass a readable UTF-8 file holding the job secret") from None
    return text.strip()


def _checked(secret: str, source: str) -> str:
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(f"{source}: the job secret has {len(secret)} characters, fewer than "
                          f"{MIN_SECRET_CHARS}; use a long random one, e.g. `openssl rand -hex 32`")
    return secret


def worker_environment(secret: str | None) -> dict[str, str | None]:
    """Variables to set (``None``: to remove) in the environment the workers inherit."""
    if secret is None:
        return {SECRET_ENV: None, INSECURE_ENV: "1"}
    return {SECRET_ENV: secret, INSECURE_ENV: None}


# --------------------------------------------------------------------------- worker side


def admit_peers(device: torch.device, group: dist.ProcessGroup | None = None, secret: str | None = None) -> None:
    """Prove this worker holds the job secret and check every peer's proof; raises
    :class:`AdmissionError` (after logging it) if any peer fails. Call before any collective.
    ``secret``: the one a group between torch worlds proves instead, since each world's launcher
    has its own (launch/psgroups.py)."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return  # new_group hands this to ranks outside the group: nothing to check here
    # A group's own size and rank: it may be a group not registered with the default one (the
    # parameter server's cross-role group, mesh.py), which dist.get_rank(group) does not know.
    world = group.size() if group is not None else dist.get_world_size()
    if world == 1:
        return
    own, insecure, master = worker_admission_env()
    secret = secret or own
    rank = group.rank() if group is not None else dist.get_rank()  # proofs bind the rank within this group
    if not secret:
        if insecure:
            return
        _refuse(dist.get_rank(), f"has no job secret, so it cannot prove it belongs to the job; start "
                      f"workers with `allhands train`/`allhands launch`, or set {SECRET_ENV} to "
                      f"the same value for every worker ({INSECURE_ENV}=1 skips the check: not "
                      f"advised)")
    key = secret.encode("utf-8")

    mine = secrets.token_bytes(_NONCE)
    nonces = _all_gather(mine, world, device, group)
    if nonces[rank] != mine:
        _refuse(dist.get_rank(), "its own nonce came back changed: the process group is tampered with")
    transcript = hashlib.sha256(_TAG + struct.pack(">Q", world) + b"".join(nonces)).digest()

    addr = _local_address(master).encode("utf-8")[:_ADDR]
    pid = os.getpid()
    proof = bytes.fromhex(prove(key, transcript, rank, _context(pid, addr)))
    record = proof + struct.pack(">QB", pid, len(addr)) + addr.ljust(_ADDR, b"\0")
    refused = []
    for r, rec in enumerate(_all_gather(record, world, device, group)):
        if r == rank:
            continue
        their_proof, (their_pid, n) = rec[:32], struct.unpack(">QB", rec[32:41])
        their_addr = rec[41:41 + min(n, _ADDR)]
        if not verify(key, transcript, r, their_proof.hex(), _context(their_pid, their_addr)):
            shown = their_addr.decode("utf-8", "replace") or "no address"
            glob = _global_rank(group, r)
            refused.append(f"rank {glob} (says {shown}, pid {their_pid})")
    if refused:
        _refuse(dist.get_rank(), f"refused {', '.join(refused)}: no valid proof of the job secret (a "
                      f"process outside the job, or a node started with another secret)")


def _global_rank(group: dist.ProcessGroup | None, r: int) -> int:
    try:
        return r if group is None else dist.get_global_rank(group, r)
    except ValueError:  # an unregistered group spans the whole job: its ranks are the job's
        return r


def _context(pid: int, addr: bytes) -> bytes:
    return struct.pack(">QB", pid, len(addr)) + addr


def _refuse(rank: int, why: str) -> NoReturn:
    msg = (f"admission: worker rank {rank} {why}; stopped before any tensor of the job was "
           f"exchanged")
    print(f"allhands: {msg}", file=sys.stderr, flush=True)
    try:  # drop the connections to the refused peers now, not in an exit-time destructor
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the refusal below is what matters
        pass
    raise AdmissionError(msg)


def _all_gather(data: bytes, world: int, device: torch.device,
                group: dist.ProcessGroup | None) -> list[bytes]:
    """Fixed-size raw bytes from every rank: uint8 tensors, never pickled objects."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    out = [torch.empty_like(t) for _ in range(world)]
    if group is None:
        dist.all_gather(out, t)
    else:  # the group's own collective: it may not be registered (see admit_peers)
        group.allgather([out], [t]).wait()
    return [o.cpu().numpy().tobytes() for o in out]


def _local_address(master: tuple[str, int] | None) -> str:
    """This host's address on the route to the worker store (what a peer would see)."""
    if master is None:
        return socket.gethostname()
    try:
        family = socket.AF_INET6 if ":" in master[0] else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(master)  # UDP connect sends nothing; it only picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


# --------------------------------------------------------------------------- the proof


def new_secret() -> bytes:
    """A fresh 256-bit job secret."""
    return secrets.token_bytes(32)


def _message(nonce: bytes, rank: int, context: bytes = b"") -> bytes:
    # Length-prefixed nonce and a fixed-width rank keep the fields unambiguous
    # (b"1" + 23 differs from b"12" + 3); the context (pid, address) comes last.
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 2**64:
        raise ValueError(f"rank must be an int in [0, 2**64), got {rank!r}")
    return struct.pack(">I", len(nonce)) + bytes(nonce) + struct.pack(">Q", rank) + bytes(context)


def prove(secret: bytes, nonce: bytes, rank: int, context: bytes = b"") -> str:
    """Hex HMAC-SHA256 of ``nonce, rank, context`` under the job secret: proves it, reveals
    nothing about it."""
    return hmac.new(secret, _message(nonce, rank, context), hashlib.sha256).hexdigest()


def verify(secret: bytes, nonce: bytes, rank: int, proof: str, context: bytes = b"") -> bool:
    """Whether ``proof`` is :func:`prove` of these inputs (constant-time comparison)."""
    if not isinstance(proof, str):
        return False
    try:
        given = proof.encode("ascii")
        expected = prove(secret, nonce, rank, context).encode("ascii")
    except (UnicodeEncodeError, ValueError):
        return False
    return hmac.compare_digest(given, expected)
