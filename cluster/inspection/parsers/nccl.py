"""Parse NCCL_DEBUG=INFO/TRACE logs (NCCL 2.4 to 2.30): which transport NCCL really used, and what failed.

The only proof of the data path is in the log: `via NET/IB/0/GDRDMA` versus `via NET/Socket/0`.
This module reads such logs as a stream of lines, from any NCCL version and any wrapper, and
returns the facts an admin needs, deciding from the strongest evidence first: per-channel
lines, then the `Connected all rings ... GDR g` summary, then `Using network X`, then device
inventory lines (`NET/IB : Using [0]mlx5_0:1/RoCE`, `NET/Socket : Using`, `NET/OFI ...`).
What the text does not show stays UNKNOWN / null.

Envelopes understood (any mix in one file): `host:pid:tid [dev] NCCL INFO|WARN|TRACE msg` with
or without the 2.26+ `[%F %T] ` timestamp; WARN's `file.cc:line [(func)]`; bare
`NCCL version x.y.z+cudaX.Y` lines (<= 2.21); prefixes from Ray `(RayWorkerWrapper pid=..,
ip=..)` (nested, ANSI coloured with or without the ESC byte, `[repeated Nx across cluster]`),
SkyPilot `(head, rank=0, pid=..) [host:0]:`, srun `0: `, pdsh `host: `, mpirun `[1,0]<stdout>:`,
CloudWatch `  | <iso time> | ...` columns (duplicated column included); two log lines glued
together; lines torn by the wrapper (a fragment `6] via P2P/IPC` still counts as transport
evidence). nccl-tests result tables (busbw per size, `# Avg bus bandwidth`) and the
`#  Rank  0 ... on host device 0` listing are read too.

Streaming: `NcclLogAccumulator.feed(line)` / `feed_lines(it)` / `feed_block(text)` /
`feed_stream(file)` then
`result()`; `parse_file(path)` reads 1 MiB blocks and iterates their lines in C, so memory
stays flat whatever the file size or line length (a line is read up to LINE_MAX characters;
`lines_truncated` counts the longer ones). Lines are first counted (in C, by a Counter over a bounded
window of distinct lines) and each distinct line is then handled once with its multiplicity:
every fact kept is a count, a set, a maximum or the first value the log gives (a window is
handled in the order its lines first appear), so where a window falls never matters, and a log
that repeats itself (every rank and every communicator prints the same lines) costs little more
than reading it. parse_file counts a step earlier still: whole-line chunks that begin at a
process's first line (`NCCL INFO NCCL version`), each found by its length and ends and confirmed
by a comparison in place, each distinct chunk then split into lines once, so a log that repeats
whole process outputs (a job relaunched, logs concatenated) costs about a memcmp of its bytes.
A distinct line is dispatched on the first 4 characters of its message; regexes
run only on the few line kinds that carry facts, and envelope heads and channel messages are
parsed once each (bounded caches). docs/nccl-parser.md explains the keys. This module only
reads: the status, the findings and the verdict sentence are cluster/inspection/checks/nccl.py's.

Issue 15 classes: the transport is also read from the source files of WARN lines and failed-call
stacks (transport/net_ib.cc = IB verbs, transport/net_socket.cc = sockets); RoCE is told from
InfiniBand by RoCE-only facts (IPv4-mapped GIDs, GID-index settings, an Ethernet link layer), not
by "NET/IB"; one node only with a proof (nNodes 1, one process driving every rank, every rank on
one host, P2P/SHM hops joining every rank, loopback bootstrap); a failed call's stack is an error
only when nothing shows the process recovering (init completing without an error WARN or abort).

Returned shape, `NcclLog.to_dict()` (contract keys first, then extras)::

    {"nccl_version": "2.27.5+cuda12.9" | null, "n_ranks": 16 | null, "n_nodes": 2 | null,
     "inter_node_transport": "IB"|"ROCE"|"SOCKET"|"OFI"|"NONE"|"UNKNOWN",
     "gdr": true | false | null,
     "intra_node_transports": ["P2P_IPC", ...]   # subset of P2P_IPC P2P_CUMEM P2P_DIRECT SHM NVLS NET
     "ib_hcas": ["mlx5_0:1", ...], "socket_ifaces": ["eth0", ...],
     "errors": [{"kind", "severity", "message", "line", "count", "hosts"}],
     "warnings": [... same shape ...],
     "busbw_gbps": 156.742 | null,              # nccl-tests "# Avg bus bandwidth"
     # extras
     "nccl_versions", "version_mismatch_suspected", "n_ranks_min", "n_nodes_min", "evidence",
     "network", "link_layers", "gdr_asymmetric", "gdr_by_host", "gdr_by_rank", "channel_counts",
     "collnet", "nvls", "pxn", "bootstrap_ifaces", "net_plugin", "hosts", "ray_node_ips",
     "ranks_incomplete", "communicators", "notes", "nccl_tests", "env",
     "cuda_driver_version", "lines", "nccl_lines", "lines_truncated", "link_layer_evidence",
     "source_transports", "net_socket_ifaces", "ofi_provider", "link_layers_mixed", "gdr_mixed"}

Raises ParseError("nccl", ...) for text with no NCCL envelope line, no NCCL version line, no
nccl-tests table and no NCCL error message at all.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from cluster.base.errors import ParseError
from cluster.base.results import Record

KIND = "nccl"

INTER_NODE_TRANSPORTS = ("IB", "ROCE", "SOCKET", "OFI", "NONE", "UNKNOWN")
INTRA_NODE_TRANSPORTS = ("P2P_IPC", "P2P_CUMEM", "P2P_DIRECT", "SHM", "NVLS", "NET")

BLOCK_BYTES = 1 << 20          # read buffer of parse_file; block size of feed_text
_PENDING_MAX = 50_000          # distinct lines counted before they are handled (bounds memory)
_FILE_BATCH = 65_536           # lines counted between two checks of that bound
_HEAD_CACHE_MAX = 8192         # distinct envelope prefixes remembered (cleared when full)
_CHAN_CACHE_MAX = 1 << 16      # distinct channel messages remembered (cleared when full)
_MAX_FINDINGS = 200            # distinct error/warning kinds+messages kept; the rest only counted
_MAX_KEYS = 1 << 17            # bound on per-rank / per-host maps (memory stays flat)
LINE_MAX = 1 << 16             # chars of a line that are read; the rest is dropped (lines_truncated)
_CUT_KEEP = LINE_MAX + 3       # what the stream reader keeps of an over-long line (flagged as cut)
_WINDOW_BYTES = 64 << 20       # raw bytes counted into the window before it is handled
_CHUNK_ANCHOR = b"NCCL INFO NCCL version"   # a process's first log line: where a repeated log repeats from
_CHUNK_MIN = 1 << 16           # characters a chunk holds at least (not searched: bounds the search)
_PRINT_CHARS = 64              # a chunk's first and last characters in its print (_ChunkCounts)
_HEAD_WINDOW = 2048            # the envelope head is looked for in the last chars before "NCCL "
_NORM_INPUT = 512              # chars of a message normalised into a finding's key
_GLUED_MAX = 32                # log lines glued into one line that are split apart (the rest stays)

# ---------------------------------------------------------------------------------------------
# Regexes (compiled once). Each runs only on lines that passed a substring prefilter, and every
# one runs in time linear in its input: no unbounded quantifier can rescan what another one (or
# another start position) already consumed. Repeats are bounded ({1,253} for a host name,
# {1,10} for a number), searches start at a literal found by str.find, and the text searched is
# bounded (a line is cut at LINE_MAX, the envelope head searched in its last _HEAD_WINDOW chars,
# a message normalised from its first _NORM_INPUT chars). tests/test_nccl_parser.py holds the
# pathological inputs (50 MB of one character, runs of digits or spaces) as regressions and
# scripts/bench_nccl_parse.py --long-lines prints the time per MB from 1 KB to 50 MB lines.

# The envelope head right before "NCCL INFO": host:pid:tid [dev]. The host may be glued to a
# SkyPilot "[host:0]:" or CloudWatch timestamp in front; '/' and '|' are never part of it.
# Its tail ":pid:tid [dev]" is found first (it starts at a ":"); the host is read backwards.
_HEAD_ANCHOR_RE = re.compile(r":(\d{1,10}):(\d{1,10}) \[(\d{1,6})\]")
_HOST_STOP = frozenset(":/|()<>")
_HOST_MAX = 253
_ISO_TS_RE = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?")
_RAY_IP_RE = re.compile(r"\bip=(\d{1,3}(?:\.\d{1,3}){3})")
# GitHub turns "net_ib.cc:101" and IPs of a pasted log into "[net_ib.cc:101](http://net_ib.cc:101/)".
_MD_LINK_RE = re.compile(r"\[([^\[\]\s]{1,200})\]\(https?://[^()\s]{1,300}\)")
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]{0,32}[ -/]{0,4}[@-~]")
# Trailing wrapper junk on a message, matched only where a '[' is: ANSI colour (with or without
# ESC) or Ray's dedup suffix. _strip_junk cuts the message there.
_JUNK_AT_RE = re.compile(r"\[(?:\d{1,3}(?:;\d{1,3}){0,8}m|repeated \d{1,12}x across cluster\])")

# "Channel 06/0 : 7[7] -> 14[6] [receive]" / "Ring 00 : 3 -> 4 [send]" / "Channel 01 : 2[c7000] -> 0[87000]"
# Matched only at " -> " (found by str.find), in a bounded window around it.
_CHAN_RE = re.compile(r"(?<![0-9a-fA-F\]])(\d{1,9})(?:\[([0-9a-fA-F]{1,16})\])? -> (\d{1,9})"
                      r"(?:\[([0-9a-fA-F]{1,16})\])?(?: \[(send|receive)\])?")
_CHAN_BEFORE = 32              # chars before " -> " that can hold "rank[busId]"
_CHAN_AFTER = 48               # chars after it: "rank[busId] [receive]"
_COLLNET_RE = re.compile(r"CollNet (\d{1,6})(?:/\d{1,6})? : (\d{1,9}) \[(send|receive)\]")

_VERSION_RE = re.compile(
    r"NCCL version (\d{1,4})\.(\d{1,4})\.(\d{1,4})([0-9A-Za-z\-]{0,32}(?:\+cuda\d{1,4}(?:\.\d{1,4})?)?)")
_VLLM_VERSION_RE = re.compile(r"using nccl==(\d{1,4})\.(\d{1,4})\.(\d{1,4})")
_COMM_SHAPE_RE = re.compile(
    r"comm (0x[0-9a-fA-F]{1,16}) rank (\d{1,9}) nRanks (\d{1,9}) nNodes (\d{1,9})(?: localRanks (\d{1,9}))?")
_INIT_RE = re.compile(          # the part before " - Init START|COMPLETE" (found by str.rfind)
    r"comm (0x[0-9a-fA-F]{1,16}) rank (\d{1,9}) nranks (\d{1,9}) cudaDev (\d{1,6})(?: nvmlDev \d{1,6})?"
    r"(?: busId ([0-9a-fA-F]{1,16}))?")
# 2.21+: "Trees [0] ... comm 0x5609976f9470 nRanks 32 busId 17000" (the communicator's size)
_TREES_NRANKS_RE = re.compile(r"comm 0x[0-9a-fA-F]{1,16} nRanks (\d{1,9})\b")
_RINGS_RE = re.compile(r"Connected all rings, use ring PXN (\d{1,3}) GDR (\d{1,3})")
_RANK_IN_INIT_TIMING_RE = re.compile(r"\brank (\d{1,9}) nranks (\d{1,9})")
_ENV_RE = re.compile(r"(NCCL_\w{1,64}) set (?:by environment )?to ")
_IB_DEV_RE = re.compile(r"\[(\d{1,4})\]\s{0,4}([A-Za-z0-9_.\-]{1,64}):(\d{1,4})(?::\d{1,6}){0,4}/(IB|RoCE)\b")
_OOB_RE = re.compile(r"OOB ([^\s:;<]{1,64}):")
_SOCK_DEV_RE = re.compile(r"\[\d{1,4}\]([^\s:\[\]]{1,64}):")
_BOOT_RE = re.compile(r"Using \[?\d{0,4}\]?([^\s:\[\]]{1,64}):")
_OFI_PROVIDER_RE = re.compile(r"Selected [Pp]rovider is ([^\s,]{1,64})(?:.{0,200}?found (\d{1,6}) nics)?")
_OFI_VERSION_RE = re.compile(r"(?:Initializing|Using) aws-ofi-nccl (\S{1,64})")
_PLUGIN_VERSION_SUFFIX_RE = re.compile(r" \(v\d{1,4}\)$")
_GDR_GPU_RE = re.compile(r"GPU Direct RDMA (Enabled|Disabled) for (?:GPU )?(\S{1,64})")
_GDR_HCA_RE = re.compile(r"GPU Direct RDMA (Enabled|Disabled) for HCA (\d{1,4}) '([^']{1,64})'")
_SHARP_RE = re.compile(r"SHARP rank (\d{1,9})/(\d{1,9}) initialized on (\S{1,64})")
_CHANNEL_COUNTS_RE = re.compile(
    r"(\d{1,6}) coll channels, (?:(\d{1,6}) collnet channels, )?(?:(\d{1,6}) nvls channels, )?"
    r"(\d{1,6}) p2p channels")
# "transport/net_ib.cc:1295" (WARN) / "transport/net_ib.cc:1295 -> 6" (the stack of a failed call):
# matched at the start of the message only.
_SRC_NAME = r"([\w./+-]{1,160}?\.(?:cc|c|cu|h|hpp|cpp|cxx))"
_TRACE_RE = re.compile(_SRC_NAME + r":(\d{1,6}) -> (\d{1,4})")
_SRC_RE = re.compile(_SRC_NAME + r":(\d{1,6})\b")
# What follows an envelope head: TRACE's "<ms> " then WARN's / TRACE's "file.cc:NNN".
_SRC_AFTER_HEAD_RE = re.compile(r" {0,4}(?:\d{1,12}\.\d{1,9} )?" + _SRC_NAME + r":(\d{1,6})")
# RoCE v2 GIDs: IPv4-mapped "::ffff:10.0.0.1" (not a socket address "<port>"), or the 2.19+
# hex form "GID 3 (0/0A00000AFFFF0000)" (subnet prefix 0, interface id ::ffff:a.b.c.d).
# The HCA a NET/IB WARN names: "NET/IB : mlx5_0:1 Got async event" / 2.27+ "... hca mlx5_10".
_WARN_HCA_RE = re.compile(r"^NET/IB ?: ([A-Za-z][\w.\-]{0,31}:\d{1,3}) |\bhca ([A-Za-z][\w.\-]{0,31})")
_MAPPED_GID_RE = re.compile(r"::ffff:(\d{1,3}(?:\.\d{1,3}){3})(?![\d.<])", re.IGNORECASE)
_HEX_GID_RE = re.compile(r"GID \d{1,4} \(0/[0-9A-Fa-f]{1,8}FFFF0000\)")
_PEER_IFACE_RE = re.compile(r"%([A-Za-z][\w.\-]{0,31})<\d{1,6}>")
# Addresses, pointers, numbers and hex ids vary between otherwise identical messages.
_NORM_RE = re.compile(r"[^\s<]{1,64}<\d{1,8}>|0x[0-9a-fA-F]{1,32}|[0-9a-fA-F:]{0,64}\d[0-9a-fA-F:]{0,64}")
_OLD_WARN_RE = re.compile(r"\[(\d{1,6})\] ([\w./+-]{1,160}:\d{1,6}) WARN ")

# nccl-tests
_NT_ROW_HINT_RE = re.compile(
    r"\d\s{1,64}(?:float|half|double|bfloat16|u?int(?:8|32|64)|fp8_e4m3|fp8_e5m2|f8e4m3|f8e5m2|char|int)\s")
_NT_TYPES = frozenset("int8 uint8 int32 uint32 int64 uint64 half float double bfloat16 fp8_e4m3 "
                      "fp8_e5m2 f8e4m3 f8e5m2 char int".split())
_ROW_ENDS = frozenset("0123456789A")  # a result row ends with #wrong (a count, or N/A)
_NT_OPS = frozenset("sum prod max min avg premulsum mulsum none".split())
_NT_AVG_RE = re.compile(r"#\s{0,64}Avg bus bandwidth\s{0,64}:\s{0,64}(\d{1,16}(?:\.\d{1,16})?(?:[eE][+-]?\d{1,3})?)(?![\d.])")
_NT_OOB_RE = re.compile(r"#\s{0,64}Out of bounds values\s{0,64}:\s{0,64}(\d{1,18})\s{0,64}(OK|FAILED)?")
_NT_RANK_RE = re.compile(r"#\s{0,64}Rank\s{1,64}(\d{1,9})\s{1,64}Group\s{1,64}\d{1,9}\s{1,64}Pid\s{1,64}(\d{1,10})"
                         r"\s{1,64}on\s{1,64}(\S{1,253})\s{1,64}device\s{1,64}(\d{1,6})")
_NT_COLL_RE = re.compile(r"\b(all_reduce|all_gather|reduce_scatter|broadcast|reduce|alltoall|sendrecv|"
                         r"scatter|gather|hypercube)_perf\b")

# Launchers (weakest evidence, used only when NCCL itself does not say): torchrun flags,
# c10d's store barrier ("with N nodes" counts ranks), PyTorch Lightning's start line.
_NNODES_RE = re.compile(r"--nnodes[= ](\d{1,6})(?::(\d{1,6}))?")
_NPROC_RE = re.compile(r"--nproc[_-]per[_-]node[= ](\d{1,6})")
_WORLD_RE = re.compile(r"store-based barrier for key:\S{1,256}? with (\d{1,9}) nodes|Starting with (\d{1,9}) processes|"
                       r"\bworld_size=(\d{1,9}) rank=\d{1,9} local_rank=")
_VLLM_NODES_RE = re.compile(r"Detected (\d{1,6}) nodes in the distributed environment")   # vLLM

# Errors PyTorch / launchers print when NCCL failed (no NCCL_DEBUG needed).
_APP_ERRORS: tuple[tuple[str, str], ...] = (
    ("Watchdog caught collective operation timeout", "collective_timeout"),
    ("detected by watchdog", "collective_timeout"),
    ("NCCL failure", "nccl_call_failed"),
    ("NCCL error", "nccl_call_failed"),
    ("ncclSystemError", "nccl_call_failed"),
    ("ncclInternalError", "nccl_call_failed"),
    ("ncclRemoteError", "nccl_call_failed"),
    ("ncclUnhandledCudaError", "nccl_call_failed"),
    ("ncclInvalidUsage", "nccl_call_failed"),
    ("unhandled system error", "nccl_call_failed"),
    ("unhandled cuda error", "nccl_call_failed"),
    ("remote process exited or there was a network error", "connection_lost"),
)

# WARN classification: first match wins. (substrings, any of which matches; kind; severity)
# Issue 26: NCCL prints a WARN and goes on where an optional lookup fails (NVML cannot see a
# GPU hidden by a container, cgroup or MIG; a sysfs path of a soft-RoCE or virtual device is
# missing; a NIC's speed file is absent) or where a setting is deprecated: those are warnings.
# When such a lookup really breaks init, the failed call's stack ("graph/xml.cc:850 -> 2") and
# the application's abort that follow are the errors (_stack_severity).
_BENIGN_WARNS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("nvmlDeviceGetHandleByPciBusId() failed", "nvmlDeviceGetHandleByIndex() failed",
      "nvmlDeviceGetNvLinkCapability() failed", "nvmlDeviceGetP2PStatus() failed",
      "nvmlDeviceGetNvLinkRemotePciInfo() failed"), "nvml_lookup_failed"),
    (("Could not find real path of", "Could not get speed from", "Could not get port speed"),
     "topology_lookup_failed"),
    (("is deprecated", "deprecated, please use", "has been deprecated"), "deprecated_setting"),
)
_WARN_RULES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    *((needles, kind, "warning") for needles, kind in _BENIGN_WARNS),
    (("Got completion", "got completion with error"), "ib_completion_error", "error"),
    (("async fatal event",), "ib_async_fatal_event", "error"),
    # QP/CQ/device errors among the async events break the connection; port and SM events do not
    (("work queue error", "catastrophic", "CQ error", "access violation", "path migration error",
      "port error"), "ib_async_error_event", "error"),
    (("Got async event",), "ib_async_event", "warning"),
    (("no socket interface found", "No socket interface found", "No usable listening interface",
      "no usable listening interface"), "no_socket_interface", "error"),
    (("Error while creating shared memory segment", "posix_fallocate failed", "/dev/shm"),
     "shm_too_small", "error"),
    (("ibv_reg_dmabuf_mr", "dmabuf", "DMA-BUF", "DMABUF"), "dmabuf_registration", "error"),
    (("Connection refused",), "connection_refused", "error"),
    (("socketStartConnect", "Connect to ", "connection abort", "Connection closed by remote peer",
      "Connection reset by peer", "socketProgress", "remote process exited"), "connection_failed", "error"),
    (("incompatible devices",), "mixed_link_layers", "error"),
    (("Cannot initialize CollNet",), "collnet_unavailable", "warning"),
    (("SHARP", "CollNet", "collNet"), "collnet_failure", "error"),
    (("Call to bind failed",), "bind_failed", "error"),
    (("Cuda failure", "CUDA error", "cuda failure"), "cuda_error", "error"),
    (("Failed to open libibverbs",), "ibverbs_missing", "warning"),
    (("NET/Plugin", "plugin", "Plugin", "NET/OFI"), "plugin_failure", "warning"),
    (("imeout", "timed out"), "timeout", "error"),
)

# Source files that name a transport ("transport/net_ib.cc:1295", "net_socket.cc:NNN -> 2"): the
# IB verbs path (IB or RoCE), the socket transport, and the intra-node ones.
def _source_transport(path: str) -> str | None:
    base = path.rsplit("/", 1)[-1]
    if "net_ib" in path or base in ("ib_plugin.c", "p2p_plugin.c"):
        return "IB"                         # transport/net_ib.cc, net_ib/*.cc; HPC-X IBext plugin
    if base.startswith("nccl_ofi"):         # aws-ofi-nccl: nccl_ofi_net.c, nccl_ofi_rdma.cpp ...
        return "OFI"
    if base.startswith("net_socket"):
        return "SOCKET"
    if base == "p2p.cc":
        return "P2P"
    if base == "shm.cc" and "transport" in path:
        return "SHM"
    if base == "nvls.cc":
        return "NVLS"
    if base in ("coll_net.cc", "collnet.cc"):
        return "COLLNET"
    return None


# Env settings that only a RoCE fabric uses (the GID picks the RoCE version / address family).
_ROCE_ENV = ("NCCL_IB_GID_INDEX", "NCCL_IB_ROCE_VERSION_NUM", "NCCL_IB_ADDR_FAMILY", "NCCL_IB_ADDR_RANGE")
# Frames of the old (<= 2.8) GPUDirect probe: "include/net.h:NN -> 2" alone, NCCL goes on without GDR.
_PROBE_FRAMES = frozenset(("include/net.h",))

_NCCL_RESULT = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError"}

# Net names as NCCL prints them -> inter_node_transport family.
def _net_family(name: str | None) -> str:
    if not name:
        return "UNKNOWN"
    low = name.lower()
    if low.startswith("socket"):
        return "SOCKET"
    if "libfabric" in low or low.startswith("ofi") or "efa" in low:
        return "OFI"
    if low.startswith("ib") or low.startswith("gib") or low in ("sharp", "rdma"):
        return "IB"
    return "UNKNOWN"


def _version_key(v: tuple[int, int] | None) -> str:
    return f"{v[0]}.{v[1]}" if v else "?"


# ---------------------------------------------------------------------------------------------
# Result types


@dataclass(frozen=True)
class Finding(Record):
    """One classified WARN/error (or warning) line kind, with how often it was seen."""

    kind: str
    severity: str           # "error" | "warning"
    message: str
    line: str               # the first raw line of this kind (bounded length)
    count: int
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class NcclLog:
    """What an NCCL log shows; see the module docstring for the JSON shape."""

    nccl_version: str | None
    nccl_versions: tuple[str, ...]
    version_mismatch_suspected: bool
    n_ranks: int | None
    n_ranks_min: int | None
    n_nodes: int | None
    n_nodes_min: int | None
    inter_node_transport: str
    network: str | None
    gdr: bool | None
    gdr_asymmetric: bool
    gdr_by_host: Mapping[str, Any]
    gdr_by_rank: Mapping[str, Any]
    intra_node_transports: tuple[str, ...]
    channel_counts: Mapping[str, int]
    ib_hcas: tuple[str, ...]
    link_layers: tuple[str, ...]
    link_layer_evidence: tuple[str, ...]
    source_transports: Mapping[str, int]
    socket_ifaces: tuple[str, ...]
    bootstrap_ifaces: tuple[str, ...]
    net_plugin: Mapping[str, Any] | None
    collnet: bool
    nvls: bool
    pxn: bool
    hosts: tuple[str, ...]
    ray_node_ips: tuple[str, ...]
    ranks_incomplete: tuple[Mapping[str, Any], ...]
    communicators: tuple[Mapping[str, Any], ...]
    errors: tuple[Finding, ...]
    warnings: tuple[Finding, ...]
    notes: tuple[str, ...]
    nccl_tests: Mapping[str, Any] | None
    busbw_gbps: float | None
    env: Mapping[str, str]
    cuda_driver_version: int | None
    evidence: Mapping[str, str | None]
    lines: int
    nccl_lines: int
    lines_truncated: int
    net_socket_ifaces: tuple[str, ...]     # the NET/Socket data interfaces ("NET/Socket : Using")
    ofi_provider: str | None               # libfabric's provider named by the OFI plugin
    link_layers_mixed: bool                # HCAs of both link layers listed, none shown in use
    gdr_mixed: bool                        # GDR on some channels (or GPUs) and not on others

    def to_dict(self) -> dict[str, Any]:
        return {
            "nccl_version": self.nccl_version,
            "n_ranks": self.n_ranks,
            "n_nodes": self.n_nodes,
            "inter_node_transport": self.inter_node_transport,
            "gdr": self.gdr,
            "intra_node_transports": list(self.intra_node_transports),
            "ib_hcas": list(self.ib_hcas),
            "socket_ifaces": list(self.socket_ifaces),
            "errors": [f.to_dict() for f in self.errors],
            "warnings": [f.to_dict() for f in self.warnings],
            "busbw_gbps": self.busbw_gbps,
            "nccl_versions": list(self.nccl_versions),
            "version_mismatch_suspected": self.version_mismatch_suspected,
            "n_ranks_min": self.n_ranks_min,
            "n_nodes_min": self.n_nodes_min,
            "evidence": dict(self.evidence),
            "network": self.network,
            "link_layers": list(self.link_layers),
            "link_layer_evidence": list(self.link_layer_evidence),
            "source_transports": dict(self.source_transports),
            "gdr_asymmetric": self.gdr_asymmetric,
            "gdr_by_host": dict(self.gdr_by_host),
            "gdr_by_rank": dict(self.gdr_by_rank),
            "channel_counts": dict(self.channel_counts),
            "collnet": self.collnet,
            "nvls": self.nvls,
            "pxn": self.pxn,
            "bootstrap_ifaces": list(self.bootstrap_ifaces),
            "net_plugin": dict(self.net_plugin) if self.net_plugin else None,
            "hosts": list(self.hosts),
            "ray_node_ips": list(self.ray_node_ips),
            "ranks_incomplete": [dict(r) for r in self.ranks_incomplete],
            "communicators": [dict(c) for c in self.communicators],
            "notes": list(self.notes),
            "nccl_tests": _plain(self.nccl_tests),
            "env": dict(self.env),
            "cuda_driver_version": self.cuda_driver_version,
            "lines": self.lines,
            "nccl_lines": self.nccl_lines,
            "lines_truncated": self.lines_truncated,
            "net_socket_ifaces": list(self.net_socket_ifaces),
            "ofi_provider": self.ofi_provider,
            "link_layers_mixed": self.link_layers_mixed,
            "gdr_mixed": self.gdr_mixed,
        }


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _strip_junk(text: str) -> str:
    """text without trailing wrapper junk (ANSI colour with or without ESC, Ray's
    `[repeated Nx across cluster]`) and surrounding blanks. Linear: only the '[' are tried."""
    i = text.find("[")
    while i >= 0:
        if _JUNK_AT_RE.match(text, i):
            if i and text[i - 1] == "\x1b":
                i -= 1
            return text[:i].strip()
        i = text.find("[", i + 1)
    return text.strip()


def _same_message(text: str, clean: str) -> bool:
    """_strip_junk(text) == clean, for a clean (already stripped) message, without scanning all
    of text: text must start with it and go on with nothing but blanks or wrapper junk."""
    text = text.lstrip()
    if not text.startswith(clean):
        return False
    tail = text[len(clean):].lstrip()
    if tail.startswith("\x1b"):
        tail = tail[1:]
    return not tail or (tail[0] == "[" and _JUNK_AT_RE.match(tail) is not None)


def _last_head(text: str) -> tuple[int, int, str, int, int] | None:
    """(start, end, host, pid, dev) of the last `host:pid:tid [dev]` in text, searched in its last
    _HEAD_WINDOW chars (a head sits right before 'NCCL INFO' or before WARN's file:line)."""
    base = max(0, len(text) - _HEAD_WINDOW)
    anchors = list(_HEAD_ANCHOR_RE.finditer(text, base))
    for m in reversed(anchors):
        end = m.start()
        k, lo = end, max(base, end - _HOST_MAX)
        while k > lo and not text[k - 1].isspace() and text[k - 1] not in _HOST_STOP:
            k -= 1
        if k < end:
            return k, m.end(), text[k:end], int(m.group(1)), int(m.group(3))
    return None


# ---------------------------------------------------------------------------------------------
# Via-text classification: "NET/IB/0(8)/GDRDMA", "P2P/CUMEM/read", "SHM/direct/direct", ...
# -> (family, label, intra token or None, net name or None, gdr flag, proxy flag)

_ViaInfo = tuple  # (family, label, intra, netname, gdr, proxy)


def _classify_via(text: str) -> _ViaInfo | None:
    s = _strip_junk(text)
    if s.startswith("NET/"):
        parts = s[4:].split("/")
        name = parts[0].strip() or "?"
        dev = parts[1] if len(parts) > 1 else ""
        gdr = "/GDRDMA" in s
        label = f"NET/{name}" + ("/GDRDMA" if gdr else "")
        return ("NET", label, None, name, gdr, "(" in dev)
    if s.startswith("P2P/"):
        sub = s[4:]
        for prefix, token in (("CUMEM", "P2P_CUMEM"), ("IPC", "P2P_IPC"),
                              ("direct pointer", "P2P_DIRECT"), ("direct", "P2P_DIRECT")):
            if sub.startswith(prefix):
                return ("P2P", "P2P/" + prefix.split()[0].upper().replace("DIRECT", "direct"),
                        token, None, False, False)
        if sub.startswith("MNNVL"):
            return ("MNNVL", "P2P/MNNVL", None, None, False, False)
        if sub.startswith("indirect"):
            return ("P2P", "P2P/indirect", None, None, False, False)
        return ("P2P", "P2P/other", None, None, False, False)
    if s.startswith("SHM") or s.startswith("direct shared memory"):
        return ("SHM", "SHM", "SHM", None, False, False)
    if s.startswith("COLLNET/"):
        parts = s[8:].split("/")
        name = parts[0] or "?"
        gdr = "/GDRDMA" in s
        return ("COLLNET", f"COLLNET/{name}" + ("/GDRDMA" if gdr else ""), None, name, gdr, False)
    if s.startswith("NVLS"):
        return ("NVLS", "NVLS", "NVLS", None, False, False)
    return None


# Version eras told by message wording (nccl-logs.md): (substring, lowest, highest) as (M, m).
_ERA_MARKS: tuple[tuple[str, tuple[int, int] | None, tuple[int, int] | None], ...] = (
    ("NET/Plugin : dlerror=", (2, 19), (2, 20)),
    ("NET/Plugin : No plugin found", None, (2, 20)),
    ("NET/Plugin: Could not find:", (2, 22), None),
    ("NET/Plugin: Using internal network plugin", (2, 21), (2, 21)),
    ("Bootstrap : Using", None, (2, 23)),
    ("Bootstrap: Using", (2, 24), None),
    ("Bootstrap timings", (2, 23), None),
    ("use ring PXN", (2, 24), None),
    ("Init timings - ", (2, 23), None),
    ("Assigned NET plugin", (2, 27), None),
)


# ---------------------------------------------------------------------------------------------
# The accumulator


class _ChunkCounts:
    """Distinct chunks of a log and their counts, in first-appearance order, without hashing
    every chunk: a chunk is looked up by its print (its length and its first and last
    _PRINT_CHARS characters) and confirmed by comparing it in place (a memcmp, no copy). Only a
    new chunk is sliced out; a print that two different chunks share sends the later ones to a
    table keyed by their whole text (hashed). So one comparison and at most one hash per chunk."""

    __slots__ = ("chunks", "counts", "held", "_by_print", "_by_text")

    def __init__(self) -> None:
        self.chunks: list = []
        self.counts: list[int] = []
        self.held = 0                                   # characters of the distinct chunks
        self._by_print: dict[tuple, int] = {}
        self._by_text: dict = {}

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def add(self, data: bytes | str, start: int, end: int) -> None:
        """Count data[start:end] once."""
        mark = (end - start, data[start:start + _PRINT_CHARS],
                data[max(start, end - _PRINT_CHARS):end])
        i = self._by_print.get(mark)
        if i is not None and data.startswith(self.chunks[i], start, end):
            self.counts[i] += 1
            return
        chunk = data[start:end]
        if i is None:
            self._by_print[mark] = len(self.chunks)
        else:                                            # another chunk had this print first
            j = self._by_text.get(chunk)
            if j is not None:
                self.counts[j] += 1
                return
            self._by_text[chunk] = len(self.chunks)
        self.chunks.append(chunk)
        self.counts.append(1)
        self.held += len(chunk)

    def items(self) -> Iterable[tuple[bytes | str, int]]:
        return zip(self.chunks, self.counts)


class NcclLogAccumulator:
    """Consume an NCCL log line by line (or block by block); `result()` gives the NcclLog.

    Memory is bounded by the size of the cluster (hosts, ranks, distinct message kinds),
    never by the length of the log.
    """

    def __init__(self) -> None:
        self.lines = 0
        self.nccl_lines = 0
        self.truncated = 0                             # lines longer than LINE_MAX (cut there)
        self._cut = False                              # the line being handled was cut
        self._raw: str | None = None                   # the line as written, when it was cleaned
        self.recognised = 0
        self._pending: Counter = Counter()
        self._chunks = _ChunkCounts()                   # whole-line chunks not yet split into lines
        self._heads: dict[str, tuple | None] = {}
        self._chan: dict[str, tuple | bool] = {}       # channel message -> parsed record
        self._dispatch = {
            "Chan": self._m_channel, "Ring": self._m_channel, "Coll": self._m_collnet,
            "Usin": self._m_using, "NET/": self._m_net, "Boot": self._m_bootstrap,
            "comm": self._m_comm, "nccl": self._m_comm, "[Ran": self._m_comm,
            "Init": self._m_init, "Conn": self._m_connected, "NCCL": self._m_nccl,
            "NVLS": self._m_nvls, "GPU ": self._m_gpu_gdr, "SHAR": self._m_sharp,
            "DMA-": self._m_dmabuf, "Plug": self._m_plugin_path, "P2P ": self._m_p2p_plugin,
            "Assi": self._m_assigned, "Succ": self._m_plugin_loaded, "cuda": self._m_cuda,
            "Laun": self._m_launch, "rank": self._m_rank_line, "Tree": self._m_trees,
        }
        # facts
        self.versions: dict[str, set] = {}             # version string -> hosts (None = bare line)
        self.version_hint: str | None = None           # "vLLM is using nccl==x.y.z"
        self.eras: dict[str, list] = {}                # host -> [lo, hi] from message wording
        self.hosts: set[str] = set()
        self.procs: set[tuple] = set()                 # (host, pid, dev)
        self.ray_ips: set[str] = set()
        self.chan_counts: dict[str, int] = {}
        self.intra: set[str] = set()
        self.net_agg: dict[tuple, int] = {}            # (host, erank, peer, dir, net, gdr, proxy) -> n
        self.net_fragments: dict[tuple, int] = {}      # (net, gdr) -> n, from torn lines
        self.collnet_agg: dict[tuple, int] = {}        # (host, rank, net, gdr) -> n
        self.ranks_seen: set[int] = set()              # any rank named in a channel line
        self.emitters: dict[int, set] = {}             # rank -> hosts that printed as that rank
        self.ring_sizes: set[int] = set()
        self.comm_shapes: dict[tuple, int] = {}        # (nRanks, nNodes, localRanks) -> count
        self.comm_nranks: set[int] = set()             # nranks from Init / timings lines
        self.init_start: set[tuple] = set()            # (host, pid, comm, rank, nranks)
        self.init_complete: set[tuple] = set()
        self.rings_gdr: dict[tuple, set] = {}          # (host, rank) -> {0,1} from "GDR g"
        self.rings_pxn: set[int] = set()
        self.networks: dict[str, int] = {}             # "Using network X" / "Assigned NET plugin X"
        self.ib_devs: dict[str, str] = {}              # "mlx5_0:1" -> "IB"|"RoCE"
        self.ib_no_device = False
        self.ib_error_seen = False
        self.socket_ifaces: dict[str, None] = {}
        self.net_socket_ifaces: dict[str, None] = {}
        self.boot_ifaces: dict[str, None] = {}
        self.ofi: dict[str, Any] = {}
        self.plugin: dict[str, Any] = {}
        self.gdr_gpu: dict[str, int] = {}              # "Enabled"/"Disabled" -> n (per GPU decision)
        self.gdr_hca: dict[str, str] = {}              # hca -> Enabled/Disabled
        self.nvls = False
        self.nvls_capable: set[bool] = set()
        self.collnet_channels = 0
        self.sharp_size: int | None = None
        self.dmabuf = False
        self.env: dict[str, str] = {}
        self.cuda_driver: int | None = None
        self.findings: dict[tuple, list] = {}          # (severity, kind, norm msg) -> [msg, line, n, hosts]
        self.findings_dropped = 0
        self.trace_errors: dict[tuple, list] = {}      # (code, plugin?, (host, pid)) -> [line, n, files]
        self.src_transports: dict[str, int] = {}       # transport named by a WARN / stack source file
        self.roce_evidence: dict[str, None] = {}       # why the verbs path is RoCE, not InfiniBand
        self.ib_link_evidence: dict[str, None] = {}    # why it is InfiniBand (an Ethernet-free fabric)
        self.rank_procs: dict[int, set] = {}           # rank -> {(host, pid)} that printed as it
        self.intra_edges: set[tuple] = set()           # (src, dst) of P2P/SHM channel hops
        self.done_procs: set[tuple] = set()            # (host, pid) that finished init
        self.chan_procs: set[tuple] = set()            # (host, pid) that printed channel set-up
        self.warn_err_procs: set[tuple] = set()        # (host, pid) with an error WARN
        self.aborted = False                           # the application reported an NCCL failure
        self.ib_dev_index: dict[str, int] = {}         # hca -> its [index] in the device list
        self.net_devs_used: set[int] = set()           # NET/IB/<dev> indices named by channel lines
        self.ib_index_conflict = False                 # one HCA listed under two indices
        self.warn_hcas: dict[str, None] = {}           # HCAs named by NET/IB WARN lines
        self.boot_scope: set[str] = set()              # "loopback" / "network" bootstrap interfaces
        # nccl-tests
        self.nt_rows: dict[tuple, tuple] = {}
        self.nt_avgs: dict[float, int] = {}
        self.nt_oob: int | None = None
        self.nt_seen = False
        self.nt_ranks: dict[int, str] = {}
        self.nt_collective: str | None = None
        # launchers
        self.hint_world: int | None = None
        self.hint_nnodes: int | None = None
        self.hint_nproc: int | None = None

    # -- input -----------------------------------------------------------------------------
    #
    # Lines are not handled as they arrive: they are counted into `_pending` (a Counter, so the
    # counting runs in C) and handled once per distinct line, with its multiplicity, when the
    # window fills up or at result(). Every fact kept is a count, a set, a maximum or the first
    # value seen (a value field is set once: a window is handled in the order its lines first
    # appear, so the first value handled is the log's first, wherever the windows fall), so
    # this gives exactly what line-by-line handling would, for a fraction of the Python work on
    # logs that repeat themselves (every rank and every communicator prints the same lines).

    def feed(self, line: str | bytes) -> None:
        """One line (a trailing newline is fine)."""
        self._window()[line] += 1
        if len(self._pending) > _PENDING_MAX:
            self._flush()

    def feed_lines(self, lines: Iterable[str | bytes]) -> None:
        """Many lines (with or without their newlines), e.g. an open file."""
        it = iter(lines)
        while True:
            batch = list(itertools.islice(it, _FILE_BATCH))
            if not batch:
                return
            self._count(batch)

    def _count(self, lines: Iterable[str | bytes]) -> None:
        """Count lines into the window (in C); handle the window when it is full."""
        self._window().update(lines)
        if len(self._pending) > _PENDING_MAX:
            self._flush()

    def _count_block_lines(self, block: bytes | str, start: int, tail: bytes | str | None) -> None:
        """Count the whole lines of block[start:] in C, over a stream on the block itself (BytesIO
        shares a bytes object's buffer: no copy). The stream also yields `tail`, the block's
        unfinished last line (None when the block ends with a newline), as one more line; that
        count is taken back before the window can be handled (cheaper than counting the block's
        newlines to stop before it)."""
        pending = self._window()
        stream = _line_stream(block)
        stream.seek(start)
        pending.update(stream)
        if tail is not None:
            left = pending[tail] - 1
            if left:
                pending[tail] = left
            else:
                del pending[tail]
        if len(pending) > _PENDING_MAX:
            self._flush()

    def _count_chunks(self, data: bytes | str, end: int) -> int:
        """Count the whole lines data[:end] as chunks, each from the start of a line holding
        _CHUNK_ANCHOR (a process's first log line) to the next such line at least _CHUNK_MIN
        characters on; return where the last chunk starts (it is not counted: its end may be in
        the next block). Where a log repeats itself it repeats whole chunks: a chunk is counted
        by a comparison in place (_ChunkCounts), and its lines are counted once per distinct
        chunk (_spill_chunks). The search looks at each character about twice and turns at most
        twice per _CHUNK_MIN characters, however dense the anchors."""
        anchor, nl = (_CHUNK_ANCHOR.decode(), "\n") if isinstance(data, str) else (_CHUNK_ANCHOR, b"\n")
        find, rfind = data.find, data.rfind
        add = self._chunks.add
        start = pos = 0
        while (i := find(anchor, pos, end)) >= 0:
            line_start = rfind(nl, pos, i) + 1       # 0: the anchor's line began before pos
            if line_start and line_start - start >= _CHUNK_MIN:
                add(data, start, line_start)
                start = line_start
            pos = max(find(nl, i, end), start + _CHUNK_MIN - 1)
        return start

    def _spill_chunks(self) -> None:
        """Count the held chunks' lines into the window: each distinct chunk's lines once, times
        the chunk's count, chunks in the order they first appeared (so lines keep theirs)."""
        chunks, self._chunks = self._chunks, _ChunkCounts()
        for chunk, n in chunks.items():
            lines = _line_stream(chunk)
            pending = self._pending                  # a new window after each one handled
            if n == 1:
                pending.update(lines)
            else:
                for line, k in Counter(lines).items():
                    pending[line] += k * n
            if len(pending) > _PENDING_MAX:
                self._handle_pending()

    def feed_block(self, block: bytes | str) -> None:
        """Whole lines, newline-separated (parse_file hands over ~1 MiB of bytes at a time)."""
        sep = b"\n" if isinstance(block, bytes) else "\n"
        lines = block.split(sep)
        if not lines[-1]:
            lines.pop()
        self._count(lines)

    def feed_text(self, text: str) -> None:
        """Any amount of text holding whole lines."""
        start, size = 0, len(text)
        while start < size:
            end = text.find("\n", start + BLOCK_BYTES)
            end = size if end < 0 else end
            self.feed_block(text[start:end])
            start = end + 1

    def feed_stream(self, f: Any) -> None:
        """Count the lines of a stream (file, BytesIO, StringIO) block by block, in C: the whole lines
        are counted as chunks that start at a process's first line (_count_chunks), so a log that
        repeats itself costs one comparison per chunk; a stretch of more than a block with no such line is
        counted line by line. What is not counted yet (the last chunk, begun but maybe not ended, and
        the unfinished last line) is carried into the next block. A line longer than LINE_MAX is kept
        up to _CUT_KEEP characters (the window cuts it to LINE_MAX and counts it as truncated) and
        the rest of it is skipped unread, so memory stays bounded by the block size and the window
        however long a line is."""
        rest = None                 # read but not counted: the last chunk begun, then the unfinished line
        cut = False                 # rest ends with the start of an over-long line; skip to its end
        since_flush = 0
        while True:
            block = _read_block(f)
            if not block:
                break
            nl = "\n" if isinstance(block, str) else b"\n"
            since_flush += len(block)
            if cut:
                k = block.find(nl)
                if k < 0:
                    continue
                block, cut = block[k:], False           # its newline ends the line that was cut
            data = block if rest is None else rest + block
            end = data.rfind(nl) + 1                    # the whole lines end here
            start = self._count_chunks(data, end)
            if end - start > BLOCK_BYTES:               # no process began in over a block
                self._count_block_lines(data, start, data[end:] or None)
                start = end
            if len(data) - end >= _CUT_KEEP:            # the unfinished line is too long: keep its start
                data, cut = data[:end + _CUT_KEEP], True
            rest = data[start:] or None
            if since_flush > _WINDOW_BYTES:
                # what the window holds is its distinct lines and chunks: a log that repeats itself is
                # handled once per distinct line, not again every _WINDOW_BYTES (memory stays bounded
                # by about a window and a block, whatever the file)
                since_flush = self._held_bytes()
                if since_flush > _WINDOW_BYTES // 2:
                    self._flush()
                    since_flush = 0
        if rest:
            self._chunks.add(rest, 0, len(rest))

    def _window(self) -> Counter:
        """The line window, with the chunks counted before split into it first (so lines counted
        one by one come after them, in stream order)."""
        if self._chunks:
            self._spill_chunks()
        return self._pending

    def _held_bytes(self) -> int:
        """The size of the distinct lines and chunks the window holds (summed in C)."""
        return sum(map(len, self._pending)) + self._chunks.held

    def _flush(self) -> None:
        """Handle everything counted so far."""
        self._window()
        self._handle_pending()

    def _handle_pending(self) -> None:
        """Handle the window's distinct lines, each once with its count, in first-appearance order."""
        pending, self._pending = self._pending, Counter()
        handle = self._line
        self.lines += sum(pending.values())
        for raw, n in pending.items():
            self._cut = len(raw) > LINE_MAX + 2      # its "\r\n" aside
            if self._cut:
                raw = raw[:LINE_MAX]
                self.truncated += n
            line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
            if "\x1b" in line:
                line = _ANSI_RE.sub("", line)
            self._raw = None
            if "](http" in line:
                self._raw, line = line, _MD_LINK_RE.sub(r"\1", line)
            handle(line.rstrip("\r\n"), n)
        self._raw = None

    # -- one line --------------------------------------------------------------------------

    def _line(self, line: str, n: int, depth: int = 0) -> None:
        i = line.find("NCCL ")
        if i < 0:
            if line:
                self._other(line, n)
            return
        level = line[i + 5:i + 9]
        if level == "INFO":
            msg = line[i + 10:]
        elif level == "WARN":
            msg = line[i + 10:]
        elif level == "TRAC":
            msg = line[i + 11:]
        else:
            self._other(line, n)
            return
        head = line[:i]
        info = self._heads.get(head)
        if info is None and head not in self._heads:
            info = self._head(head)
        self.nccl_lines += n
        self.recognised += n
        j = msg.find("NCCL ")
        if j >= 0 and msg[j + 5:j + 9] in ("INFO", "WARN", "TRAC"):
            if depth < _GLUED_MAX:
                msg = self._unglue(msg, j, n, depth)
            else:                       # the rest of the glued lines is dropped
                last = _last_head(msg[:j])
                msg = msg[:last[0] if last else j].rstrip()
        if info is None:
            host = pid = src = None
        else:
            host, pid, _dev, src = info
        if src is not None:
            self._source(src, n)
        if "::ffff:" in msg or "GID " in msg:
            self._gid(msg)
        if level == "WARN":
            self._warn(msg, host, line, n, pid)
            return
        handler = self._dispatch.get(msg[:4])
        if handler is not None:
            handler(msg, host, pid, n, line)
        elif msg[:1].isdigit():
            self._m_channel_counts(msg, host, pid)
        elif " -> " in msg:
            self._m_trace(msg, host, pid, line, n)

    def _head(self, head: str) -> tuple | None:
        """host, pid, dev from the text before 'NCCL INFO' (cached per distinct head)."""
        if len(self._heads) >= _HEAD_CACHE_MAX:
            self._heads.clear()
        h = head
        if "-" in h and ":" in h:
            h = _ISO_TS_RE.sub(" ", h)
        found = _last_head(h)
        if found is None:
            self._heads[head] = None
            return None
        _start, end, host, pid, dev = found
        m = _SRC_AFTER_HEAD_RE.match(h, end) if end < len(h) else None
        src = m.group(1) if m else None
        if "ip=" in head:
            ip = _RAY_IP_RE.search(head)
            if ip and len(self.ray_ips) < _MAX_KEYS:
                self.ray_ips.add(ip.group(1))
        self._heads[head] = (host, pid, dev, src)
        if len(self.hosts) < _MAX_KEYS:
            self.hosts.add(host)
            self.procs.add((host, pid, dev))
        return self._heads[head]

    def _unglue(self, msg: str, j: int, n: int, depth: int) -> str:
        """Two log lines glued into one: handle the second one, return the first message."""
        prefix = msg[:j]
        last = _last_head(prefix)
        if last is None:
            return prefix
        cut = last[0]
        first = prefix[:cut].rstrip(" |\t")
        second = prefix[cut:] + msg[j:]
        k = second.find("NCCL ")
        if not _same_message(second[k + 10:], _strip_junk(first)):
            self._line(second, n, depth + 1)    # a CloudWatch duplicate column is the same message
        if cut and not prefix[cut - 1].isspace() and " via " in first:
            return prefix               # glued without a separator: the host may have eaten the
        return first                    # end of the via-text, which is classified by its start

    # -- message handlers (msg, host, pid, n, line) ------------------------------------------

    def _m_channel(self, msg: str, host, pid, n: int, line: str) -> None:
        rec = self._chan.get(msg)
        if rec is None:
            if len(self._chan) >= _CHAN_CACHE_MAX:
                self._chan.clear()
            rec = self._chan[msg] = self._channel_record(msg)
        if not rec:
            return
        label, intra, family, net, gdr, proxy, src, dst, direction, me, peer, dev = rec
        self.chan_counts[label] = self.chan_counts.get(label, 0) + n
        if dev is not None and len(self.net_devs_used) < 4096:
            self.net_devs_used.add(dev)
        if intra is not None:
            self.intra.add(intra)
        if src is None:
            if family == "NET":
                key = (net, gdr)
                self.net_fragments[key] = self.net_fragments.get(key, 0) + n
            return
        seen = self.ranks_seen
        if len(seen) < _MAX_KEYS:
            seen.add(src)
            seen.add(dst)
        if family in ("P2P", "SHM") and len(self.intra_edges) < _MAX_KEYS:
            self.intra_edges.add((src, dst))
        self._rank_proc(me, host, pid)
        if intra == "P2P_DIRECT":           # "P2P/direct pointer": the peer is in this process
            self._rank_proc(peer, host, pid)
        if len(self.chan_procs) < _MAX_KEYS:
            self.chan_procs.add((host, pid))
        if host is not None:
            hs = self.emitters.get(me)
            if hs is None:
                if len(self.emitters) < _MAX_KEYS:
                    self.emitters[me] = {host}
            elif host not in hs and len(hs) < 64:
                hs.add(host)
        if family == "NET":
            key = (host, me, peer, direction, net, gdr, proxy)
            agg = self.net_agg
            if key in agg:
                agg[key] += n
            elif len(agg) < _MAX_KEYS:
                agg[key] = n

    def _channel_record(self, msg: str) -> tuple | bool:
        """Everything a channel message says, parsed once per distinct message (cached)."""
        v = msg.find(" via ")
        if v < 0:
            self._ring_listing(msg)
            return False
        info = _classify_via(msg[v + 5:])
        if info is None:
            return False
        family, label, intra, net, gdr, proxy = info
        dev = None
        if family == "NET" and net in ("IB", "IBext"):   # "via NET/IB/3(8)/GDRDMA": device [3]
            d = msg[v + 5:v + 64].split("/")
            digits = d[2][:6] if len(d) > 2 else ""
            k = len(digits) - len(digits.lstrip("0123456789"))
            dev = int(digits[:k]) if k else None
        a = msg.find(" -> ", 0, v)
        m = None if a < 0 else _CHAN_RE.search(msg, max(0, a - _CHAN_BEFORE), min(v, a + 4 + _CHAN_AFTER))
        if m is None:
            return (label, intra, family, net, gdr, proxy, None, None, None, None, None, dev)
        src, dst, direction = int(m.group(1)), int(m.group(3)), m.group(5)
        me, peer = (dst, src) if direction == "receive" else (src, dst)
        return (label, intra, family, net, gdr, proxy, src, dst, direction, me, peer, dev)

    def _ring_listing(self, msg: str) -> None:
        c = msg.find(" : ")
        if c < 0:
            return
        if self._cut:
            return                      # a listing cut short would give a wrong rank count
        toks = msg[c + 3:].split()
        if toks and all(_uint(t) and len(t) < 8 for t in toks):
            self.ring_sizes.add(len(set(toks)))

    def _m_collnet(self, msg: str, host, pid, n: int, line: str) -> None:
        v = msg.find(" via ")
        if v < 0:
            return
        info = _classify_via(msg[v + 5:])
        if info is None:
            return
        family, label, _intra, net, gdr, _proxy = info
        self.chan_counts[label] = self.chan_counts.get(label, 0) + n
        self.collnet_channels += n
        m = _COLLNET_RE.search(msg)
        key = (host, int(m.group(2)) if m else None, net, gdr)
        if key in self.collnet_agg or len(self.collnet_agg) < _MAX_KEYS:
            self.collnet_agg[key] = self.collnet_agg.get(key, 0) + n

    def _m_using(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("Using network "):
            name = _strip_junk(msg[14:])
            if name:
                self.networks[name] = self.networks.get(name, 0) + n

    def _m_assigned(self, msg: str, host, pid, n: int, line: str) -> None:
        # 2.27+: "Assigned NET plugin IB to comm"
        if msg.startswith("Assigned NET plugin "):
            name = msg[20:].split(" to comm")[0].strip()
            if name:
                self.networks[name] = self.networks.get(name, 0) + n
            self._era(host, msg)

    def _m_net(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("NET/IB"):
            if "GPU Direct RDMA" in msg:
                m = _GDR_HCA_RE.search(msg)
                if m:
                    self.gdr_hca.setdefault(m.group(3), m.group(1))
            elif "Using interface " in msg:    # 2.3: "NET/IB : Using interface X for sideband ..."
                name = msg.split("Using interface ", 1)[1].split(" ", 1)[0].split(":", 1)[0]
                if name:
                    self.socket_ifaces.setdefault(name, None)
            elif " Using" in msg or msg[6:9] in (": [", " : ["):   # 2.3: "NET/IB: [2] mlx5_1:1/IB"
                for m in _IB_DEV_RE.finditer(msg):
                    hca = f"{m.group(2)}:{m.group(3)}"
                    if hca not in self.ib_devs and len(self.ib_devs) < 4096:
                        self.ib_devs[hca] = m.group(4)
                        self.ib_dev_index[hca] = int(m.group(1))
                    elif self.ib_dev_index.get(hca) != int(m.group(1)):
                        self.ib_index_conflict = True     # hosts list their HCAs differently
                m = _OOB_RE.search(msg)
                if m:
                    self.socket_ifaces.setdefault(m.group(1), None)
            elif "No device found" in msg:
                self.ib_no_device = True
            if "RoCE" in msg and " Using" not in msg and not _IB_DEV_RE.search(msg):
                self.roce_evidence.setdefault("RoCE named in a NET/IB line", None)
        elif msg.startswith("NET : Using interface "):    # 2.3
            name = msg[22:].split(":", 1)[0].split(" ", 1)[0]
            if name:
                self.socket_ifaces.setdefault(name, None)
        elif msg.startswith("NET/Socket"):
            if " Using" in msg:
                for m in _SOCK_DEV_RE.finditer(msg):
                    self.net_socket_ifaces.setdefault(m.group(1), None)
                    self.socket_ifaces.setdefault(m.group(1), None)
        elif msg.startswith("NET/OFI"):
            m = _OFI_PROVIDER_RE.search(msg)
            if m:
                self.ofi.setdefault("provider", m.group(1))
                if m.group(2):
                    self.ofi.setdefault("nics", int(m.group(2)))
                return
            m = _OFI_VERSION_RE.search(msg)
            if m:
                self.ofi.setdefault("version", m.group(1))
                return
            if "Using Libfabric version" in msg:
                self.ofi.setdefault("libfabric", msg.rsplit(" ", 1)[-1])
            elif "Invalid" in msg or "failed" in msg.lower() or "Unable" in msg:
                self.ofi.setdefault("failures", msg[8:].strip()[:200])
            self.ofi.setdefault("seen", True)
        elif msg.startswith("NET/Plugin"):
            self._era(host, msg)
            k = msg.find("Loaded net plugin ")
            name = _PLUGIN_VERSION_SUFFIX_RE.sub("", msg[k + 18:].strip()) if k >= 0 else ""
            if name:
                self.plugin.setdefault("loaded", name)
            elif "set by env to" in msg:
                self.plugin.setdefault("requested", msg.rsplit(" ", 1)[-1].strip())
            elif "using internal" in msg or "Using internal" in msg or "No plugin found" in msg:
                self.plugin.setdefault("internal", True)

    def _m_bootstrap(self, msg: str, host, pid, n: int, line: str) -> None:
        self._era(host, msg)
        if "Using" in msg:
            m = _BOOT_RE.search(msg)
            names = [d.group(1) for d in _SOCK_DEV_RE.finditer(msg)] if "[1]" in msg else []
            for name in names or ([m.group(1)] if m else []):   # <= 2.6 lists every interface
                self.boot_ifaces.setdefault(name, None)
                self.socket_ifaces.setdefault(name, None)
            if m:
                loop = m.group(1) == "lo" or ":127." in msg
                self.boot_scope.add("loopback" if loop and not names else "network")

    def _m_comm(self, msg: str, host, pid, n: int, line: str) -> None:
        k = msg.rfind(" - Init ")
        if k >= 0:
            state = msg[k + 8:k + 16]
            state = "START" if state.startswith("START") else \
                "COMPLETE" if state.startswith("COMPLETE") else None
            m = _INIT_RE.search(msg, 0, k) if state else None
            if m:
                rank, nranks = int(m.group(2)), int(m.group(3))
                key = (host, pid, m.group(1), rank, nranks)
                target = self.init_start if state == "START" else self.init_complete
                if len(target) < _MAX_KEYS:
                    target.add(key)
                self.comm_nranks.add(nranks)
                if host is not None and (rank in self.emitters or len(self.emitters) < _MAX_KEYS):
                    self.emitters.setdefault(rank, set()).add(host)
                self._rank_proc(rank, host, pid)
                if state == "COMPLETE":
                    self._done(host, pid)
            return
        if "nNodes" in msg:
            m = _COMM_SHAPE_RE.search(msg)
            if m:
                shape = (int(m.group(3)), int(m.group(4)),
                         int(m.group(5)) if m.group(5) else None)
                self.comm_shapes[shape] = self.comm_shapes.get(shape, 0) + n

    def _m_init(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("Init timings"):
            self._era(host, msg)
            m = _RANK_IN_INIT_TIMING_RE.search(msg)
            if m:
                self.comm_nranks.add(int(m.group(2)))
            self._done(host, pid)
        elif msg.startswith("Initialized NET plugin "):
            self.plugin.setdefault("initialized", {})[msg[23:].strip()] = True

    def _m_connected(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("Connected all"):
            self._done(host, pid)
        if msg.startswith("Connected all rings"):
            m = _RINGS_RE.search(msg)
            if m:
                self._era(host, msg)
                self.rings_pxn.add(int(m.group(1)))
                key = (host, pid)
                s = self.rings_gdr.get(key)
                if s is None:
                    if len(self.rings_gdr) < _MAX_KEYS:
                        self.rings_gdr[key] = {int(m.group(2))}
                else:
                    s.add(int(m.group(2)))
        elif msg.startswith("Connected NVLS"):
            self.nvls = True

    def _m_nccl(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("NCCL version"):
            self._version(msg, host)
        elif msg.startswith("NCCL_"):
            text = _strip_junk(msg)
            m = _ENV_RE.match(text)
            if m and m.group(1) not in self.env and len(self.env) < 128:
                value = text[m.end():].strip()
                if value.endswith(".") and value[:-1].lstrip("-").isdigit():
                    value = value[:-1]
                self.env[m.group(1)] = value

    def _m_nvls(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("NVLS Head") or msg.startswith("NVLS comm"):
            self.nvls = True
        elif "multicast support is" in msg:
            self.nvls_capable.add("not available" not in msg)

    def _m_gpu_gdr(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("GPU Direct RDMA"):
            m = _GDR_GPU_RE.search(msg)
            if m and not m.group(2).startswith("HCA"):
                self.gdr_gpu[m.group(1)] = self.gdr_gpu.get(m.group(1), 0) + n

    def _m_sharp(self, msg: str, host, pid, n: int, line: str) -> None:
        m = _SHARP_RE.search(msg)
        if m:
            if self.sharp_size is None:
                self.sharp_size = int(m.group(2))
            dev = m.group(3)
            if ":" in dev and dev not in self.ib_devs:
                self.ib_devs[dev] = "IB"

    def _m_dmabuf(self, msg: str, host, pid, n: int, line: str) -> None:
        if "is available" in msg:
            self.dmabuf = True

    def _m_plugin_path(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("Plugin Path"):
            self.plugin.setdefault("path", _strip_junk(msg.split(":", 1)[-1]))

    def _m_p2p_plugin(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("P2P plugin "):
            self.plugin.setdefault("loaded", _strip_junk(msg[11:]))

    def _m_plugin_loaded(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("Successfully loaded external plugin"):
            self.plugin.setdefault("external", msg.rsplit(" ", 1)[-1].strip())

    def _m_cuda(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("cudaDriverVersion "):
            v = msg[18:].split()
            if v and v[0].isascii() and v[0].isdigit() and self.cuda_driver is None:
                self.cuda_driver = int(v[0])

    def _m_channel_counts(self, msg: str, host, pid) -> None:
        # "%d coll channels, %d collnet channels, %d nvls channels, ..." - recent NCCL prints
        # comm->nChannels as the collnet count too, so only the nvls count is evidence.
        m = _CHANNEL_COUNTS_RE.match(msg)
        if m:
            self._done(host, pid)       # printed once the channels are connected
            if m.group(3) and int(m.group(3)) > 0:
                self.nvls = True

    def _m_rank_line(self, msg: str, host, pid, n: int, line: str) -> None:
        # NCCL 2.3: "rank 6 nranks 8" once a communicator is set up
        m = _RANK_IN_INIT_TIMING_RE.match(msg)
        if m:
            rank, nranks = int(m.group(1)), int(m.group(2))
            self.comm_nranks.add(nranks)
            if host is not None and (rank in self.emitters or len(self.emitters) < _MAX_KEYS):
                self.emitters.setdefault(rank, set()).add(host)
            self._rank_proc(rank, host, pid)

    def _m_trees(self, msg: str, host, pid, n: int, line: str) -> None:
        k = msg.rfind(" comm 0x")
        m = _TREES_NRANKS_RE.match(msg, k + 1) if k >= 0 and not self._cut else None
        if m:
            self.comm_nranks.add(int(m.group(1)))

    def _m_launch(self, msg: str, host, pid, n: int, line: str) -> None:
        if msg.startswith("Launch mode"):   # <= 2.7, printed at the end of init
            self._done(host, pid)

    def _done(self, host, pid) -> None:
        if len(self.done_procs) < _MAX_KEYS:
            self.done_procs.add((host, pid))

    def _rank_proc(self, rank: int, host, pid) -> None:
        if host is None:
            return
        procs = self.rank_procs.get(rank)
        if procs is None:
            if len(self.rank_procs) < _MAX_KEYS:
                self.rank_procs[rank] = {(host, pid)}
        elif len(procs) < 8:
            procs.add((host, pid))

    def _source(self, path: str, n: int) -> None:
        fam = _source_transport(path)
        if fam is not None:
            self.src_transports[fam] = self.src_transports.get(fam, 0) + n

    def _gid(self, msg: str) -> None:
        m = _MAPPED_GID_RE.search(msg) or _HEX_GID_RE.search(msg)
        if m:
            self.roce_evidence.setdefault(f"IPv4-mapped GID ({m.group(0)})", None)

    def _m_trace(self, msg: str, host, pid, line: str, n: int) -> None:
        m = _TRACE_RE.match(msg)
        if not m:
            return
        code = int(m.group(3))
        if code not in _NCCL_RESULT:
            return                      # 0 success, 7 ncclInProgress (non-blocking init)
        path = m.group(1)
        self._source(path, n)
        # the net plugin loader (2.19-2.22 src/net.cc, 2.23+ src/plugin/): a plugin that is
        # disabled or absent returns an error there and NCCL goes on with the next net
        plugin = path.startswith("plugin/") or path == "net.cc"
        key = (code, plugin, (host, pid))
        rec = self.trace_errors.get(key)
        if rec is None:
            if len(self.trace_errors) >= _MAX_FINDINGS:
                key = (code, plugin, (None, None))
                rec = self.trace_errors.get(key)
        if rec is None:
            self.trace_errors[key] = [line.strip()[:400], n, {path}]
        else:
            rec[1] += n
            if len(rec[2]) < 64:
                rec[2].add(path)

    # -- WARN lines ------------------------------------------------------------------------

    def _warn(self, msg: str, host, line: str, n: int, pid=None) -> None:
        msg = _strip_junk(msg)
        kind, severity = "nccl_warn", "error"
        for needles, k, sev in _WARN_RULES:
            if any(s in msg for s in needles):
                kind, severity = k, sev
                break
        if kind == "bind_failed" and "ras/" in line:
            severity = "warning"        # the RAS monitor could not bind; communication unaffected
        if kind == "ib_completion_error":
            self.ib_error_seen = True
        if "%" in msg:
            m = _PEER_IFACE_RE.search(msg)
            if m:
                self.socket_ifaces.setdefault(m.group(1), None)
        if msg.startswith("NET/IB") and ("async event" in msg or " hca " in msg):
            m = _WARN_HCA_RE.search(msg)
            if m and len(self.warn_hcas) < 256:
                self.warn_hcas.setdefault(m.group(1) or m.group(2), None)
        if "ibv_modify_qp" in msg and ("Network is unreachable" in msg or "No route to host" in msg):
            # only RoCE routes a QP's address through the IP stack (ENETUNREACH / EHOSTUNREACH)
            self.roce_evidence.setdefault("ibv_modify_qp: IP route to the peer's GID missing", None)
        if severity == "error" and len(self.warn_err_procs) < _MAX_KEYS:
            self.warn_err_procs.add((host, pid))
        self._finding(severity, kind, msg, line, host, n)

    def _finding(self, severity: str, kind: str, msg: str, line: str, host, n: int) -> None:
        norm = _NORM_RE.sub("N", msg[:_NORM_INPUT])[:160]
        key = (severity, kind, norm)
        rec = self.findings.get(key)
        if rec is None:
            if len(self.findings) >= _MAX_FINDINGS:
                self.findings_dropped += n
                return
            shown = self._raw if self._raw is not None else line
            self.findings[key] = [msg[:300], shown.strip()[:400], n, {host} if host else set()]
        else:
            rec[2] += n
            if host and len(rec[3]) < 16:
                rec[3].add(host)

    # -- lines without an NCCL envelope ---------------------------------------------------

    def _other(self, line: str, n: int) -> None:
        if " via " in line:
            self._fragment(line, n)
        if "NCCL version" in line:
            if self._version(line, None):
                self.recognised += n
        if "#" in line:
            self._nccl_tests_comment(line, n)
        elif "  " in line and line.rstrip()[-1:] in _ROW_ENDS and _NT_ROW_HINT_RE.search(line):
            self._nccl_tests_row(line, n)
        if " WARN " in line:
            m = _OLD_WARN_RE.search(line)
            if m:
                self.recognised += n
                self._source(m.group(2).rsplit(":", 1)[0], n)
                self._warn(line[m.end():], None, line, n)
                return
        if "NCCL" in line or "nccl" in line:
            self._app_error(line, n)
            if "NCCL_IB_GID_INDEX=" in line:
                self.roce_evidence.setdefault("NCCL_IB_GID_INDEX set", None)
        if "ink layer" in line or "ink_layer" in line or "inkLayer" in line:
            self._link_layer_line(line)
        if "libfabric" in line and ("<warn>" in line or "<error>" in line):
            self._libfabric(line, n)
        if "got completion with error" in line:
            self.ib_error_seen = True
            self._finding("error", "ib_completion_error", line.strip()[:300], line, None, n)
        if ("--nnodes" in line or "nproc" in line or "store-based barrier" in line or "Starting with" in line
                or "world_size=" in line or "Detected " in line):
            self._launcher(line)
        if "_perf" in line:
            m = _NT_COLL_RE.search(line)
            if m and self.nt_collective is None:
                self.nt_collective = m.group(1)

    def _fragment(self, line: str, n: int) -> None:
        via = line[line.find(" via ") + 5:]
        info = _classify_via(via)
        if info is None:
            return
        family, label, intra, net, gdr, _proxy = info
        self.chan_counts[label] = self.chan_counts.get(label, 0) + n
        if intra is not None:
            self.intra.add(intra)
        if family == "NET":
            key = (net, gdr)
            self.net_fragments[key] = self.net_fragments.get(key, 0) + n

    def _version(self, text: str, host) -> bool:
        m = _VERSION_RE.search(text)
        if not m:
            return False
        version = f"{m.group(1)}.{m.group(2)}.{m.group(3)}{m.group(4)}"
        hosts = self.versions.get(version)
        if hosts is None:
            if len(self.versions) >= 64:
                return True
            hosts = self.versions[version] = set()
        if len(hosts) < 4096:
            hosts.add(host)
        return True

    def _era(self, host, msg: str) -> None:
        if host is None:
            return
        for needle, lo, hi in _ERA_MARKS:
            if needle in msg:
                era = self.eras.get(host)
                if era is None:
                    if len(self.eras) >= _MAX_KEYS:
                        return
                    era = self.eras[host] = [None, None]
                if lo and (era[0] is None or lo > era[0]):
                    era[0] = lo
                if hi and (era[1] is None or hi < era[1]):
                    era[1] = hi

    def _nccl_tests_comment(self, line: str, n: int) -> None:
        if "busbw" in line or "out-of-place" in line:
            self.nt_seen = True
            self.recognised += n
        elif "Avg bus bandwidth" in line:
            m = _NT_AVG_RE.search(line)
            v = _finite(m.group(1)) if m else None
            if v is not None:
                self.nt_seen = True
                self.recognised += n
                if v in self.nt_avgs or len(self.nt_avgs) < 256:
                    self.nt_avgs[v] = self.nt_avgs.get(v, 0) + n
        elif "Out of bounds values" in line:
            m = _NT_OOB_RE.search(line)
            if m:
                self.nt_seen = True
                self.nt_oob = max(self.nt_oob or 0, int(m.group(1)))
                if m.group(2) == "FAILED" or int(m.group(1)) > 0:
                    self._finding("error", "nccl_tests_out_of_bounds", line.strip()[:300], line, None, n)
        elif "Rank" in line and " on " in line:
            m = _NT_RANK_RE.search(line)
            if m and (int(m.group(1)) in self.nt_ranks or len(self.nt_ranks) < _MAX_KEYS):
                self.nt_seen = True
                self.recognised += n
                self.nt_ranks.setdefault(int(m.group(1)), m.group(3))
        elif "nThread" in line and "nGpus" in line:
            self.nt_seen = True
            self.recognised += n

    def _nccl_tests_row(self, line: str, n: int) -> None:
        toks = line.split()
        for i in range(len(toks) - 6):
            if toks[i + 2] in _NT_TYPES and _uint(toks[i]) and _uint(toks[i + 1]):
                break
        else:
            return
        rest = toks[i + 3:]
        redop = rest.pop(0) if rest and rest[0] in _NT_OPS else None
        root = None
        if len(rest) in (5, 9) and _uint(rest[0].lstrip("-")):
            root = int(rest.pop(0))
        if len(rest) not in (4, 8):
            return
        nums = [_finite(t) for t in (rest[:3] + rest[4:7])]
        if None in nums:
            return                      # not a number, or NaN / infinite: not a result row
        oop = tuple(nums[:3])
        ip = tuple(nums[3:6]) if len(rest) == 8 else None
        wrong = [w for w in (rest[3], rest[7] if len(rest) == 8 else "0") if _uint(w)]
        bad = sum(int(w) for w in wrong)
        size = int(toks[i])
        key = (size, toks[i + 2], redop)
        if key not in self.nt_rows and len(self.nt_rows) < 4096:
            self.nt_rows[key] = (int(toks[i + 1]), root, oop, ip, bad)
        self.nt_seen = True
        self.recognised += n
        if bad:
            self._finding("error", "nccl_tests_wrong_results",
                          f"{bad} wrong elements at size {size}", line, None, n)

    def _app_error(self, line: str, n: int) -> None:
        for needle, kind in _APP_ERRORS:
            if needle in line:
                self.recognised += n
                self.aborted = True
                self._finding("error", kind, line.strip()[:300], line, None, n)
                return
        m = _VLLM_VERSION_RE.search(line)
        if m and self.version_hint is None:
            self.version_hint = f"{m.group(1)}.{m.group(2)}.{m.group(3)}"

    def _libfabric(self, line: str, n: int) -> None:
        msg = line.strip()
        if "FI_HMEM" in line and "not support" in line:
            # e.g. EFA without RDMA read/write: the provider cannot move GPU memory, no GPUDirect
            self.ofi["hmem"] = False
        if "output empty list" in line or "<error>" in line:
            kind = "ofi_provider_unavailable" if "empty list" in line else "libfabric_error"
            self._finding("error", kind, msg[:300], line, None, n)
        else:
            self._finding("warning", "libfabric_warning", msg[:300], line, None, n)

    def _link_layer_line(self, line: str) -> None:
        """ibv_devinfo / ibstat / sysfs output pasted with the log: 'link_layer: Ethernet'."""
        low = line.lower()
        k = max(low.find("link layer"), low.find("link_layer"), low.find("linklayer"))
        tail = low[k:k + 40]
        if "ethernet" in tail:
            self.roce_evidence.setdefault("Ethernet link layer", None)
        elif "infiniband" in tail:
            self.ib_link_evidence.setdefault("InfiniBand link layer", None)

    def _launcher(self, line: str) -> None:
        m = _NNODES_RE.search(line)
        if m and self.hint_nnodes is None:
            self.hint_nnodes = int(m.group(2) or m.group(1))
        m = _NPROC_RE.search(line)
        if m and self.hint_nproc is None:
            self.hint_nproc = int(m.group(1))
        m = _WORLD_RE.search(line)
        if m and self.hint_world is None:
            self.hint_world = int(m.group(1) or m.group(2) or m.group(3))
        m = _VLLM_NODES_RE.search(line)
        if m and self.hint_nnodes is None:
            self.hint_nnodes = int(m.group(1))

    # -- result ------------------------------------------------------------------------------

    def result(self) -> NcclLog:
        """The facts so far. Raises ParseError when nothing NCCL-related was seen."""
        self._flush()
        if self.recognised == 0:
            cut = (f" ({self.truncated} line(s) longer than {LINE_MAX} characters were read up to "
                   "that length only)") if self.truncated else ""
            raise ParseError(KIND, "no NCCL_DEBUG line (host:pid:tid [dev] NCCL INFO/WARN), "
                                   "NCCL version line, nccl-tests table or NCCL error found" + cut)
        return _Summary(self).build()


# ---------------------------------------------------------------------------------------------
# Reading: from the accumulated facts to ranks, nodes, transport and GDR (judged in
# cluster/inspection/checks/nccl.py)


class _Summary:
    """One pass over an accumulator's facts (pure; kept apart from the line handling)."""

    def __init__(self, acc: NcclLogAccumulator) -> None:
        self.a = acc
        self.evidence: dict[str, str | None] = {}
        self.notes: list[str] = []

    # ranks and nodes ------------------------------------------------------------------------

    def _rank_hosts(self) -> dict[int, str]:
        """rank -> host, for ranks printed from exactly one host; empty when a host name is
        redacted or generic ("xxx", "<cluster_name>", "localhost"): such names do not tell
        machines apart, so nothing is decided from them."""
        if self._anonymous_hosts():
            return {}
        return {r: next(iter(hs)) for r, hs in self.a.emitters.items() if len(hs) == 1}

    def _anonymous_hosts(self) -> bool:
        return any(_generic_host(h) for h in self.a.hosts)

    def _ranks_and_nodes(self):
        a = self.a
        n_ranks = n_nodes = None
        shapes = a.comm_shapes
        if shapes:
            biggest = max(shapes, key=lambda s: (s[0], s[1]))
            n_ranks, n_nodes = biggest[0], biggest[1]
            self.evidence["n_ranks"] = self.evidence["n_nodes"] = "comm nRanks/nNodes line"
        sizes = set(a.comm_nranks) | set(a.ring_sizes)
        if sizes and (n_ranks is None or max(sizes) > n_ranks):
            n_ranks = max(sizes)
            self.evidence["n_ranks"] = "Init/ring lines"
            if shapes and n_ranks != biggest[0]:
                n_nodes = None
                self.evidence.pop("n_nodes", None)
        if n_ranks is None and a.nt_ranks and set(a.nt_ranks) == set(range(len(a.nt_ranks))):
            # the listing starts at rank 0 and has no gap (an excerpt cut above it proves nothing)
            n_ranks = len(a.nt_ranks)
            n_nodes = len(set(a.nt_ranks.values()))
            self.evidence["n_ranks"] = self.evidence["n_nodes"] = "nccl-tests device listing"
        hosts = a.hosts | set(a.nt_ranks.values())
        rank_hosts = self._rank_hosts()
        if n_ranks is None and a.ranks_seen and a.hosts:
            # Every rank named in a channel line printed its own lines from this log, and they
            # are 0..k-1: the communicator is closed (rings span all ranks) -> k ranks.
            seen = a.ranks_seen
            k = max(seen) + 1
            # ... and no other GPU process printed (its rank would be one the channels do not name)
            if len(seen) == k and all(r in rank_hosts for r in seen) and len(a.procs) <= k:
                n_ranks = k
                self.evidence["n_ranks"] = "channel lines (every rank seen printing)"
                if n_nodes is None and len(set(rank_hosts[r] for r in seen)) == 1 and len(a.hosts) == 1:
                    n_nodes = 1
                    self.evidence["n_nodes"] = "channel lines (all ranks on one host)"
        if n_ranks is None and (a.hint_world or (a.hint_nnodes and a.hint_nproc)):
            n_ranks = a.hint_world or a.hint_nnodes * a.hint_nproc
            self.evidence["n_ranks"] = "launcher line"
        if n_nodes is None and n_ranks == 1:
            n_nodes = 1
            self.evidence["n_nodes"] = "single rank"
        many = max((sh[1] for sh in a.comm_shapes), default=0) > 1 or a.collnet_channels or a.collnet_agg
        if n_nodes is None and n_ranks and not many:
            proof = self._single_node_proof(n_ranks, rank_hosts)
            if proof:
                n_nodes = 1
                self.evidence["n_nodes"] = proof
        if n_nodes is None and n_ranks is None and not many:
            proof = self._one_host_proof(hosts)
            if proof:
                n_nodes = 1
                self.evidence["n_nodes"] = proof
        if n_nodes is None and n_ranks and n_ranks <= _MAX_KEYS and all(r in rank_hosts for r in range(n_ranks)):
            n_nodes = len({rank_hosts[r] for r in range(n_ranks)})
            self.evidence["n_nodes"] = "the host of every rank"
        if n_nodes is None and n_ranks is not None and len(hosts) == n_ranks and not self._anonymous_hosts():
            n_nodes = n_ranks
            self.evidence["n_nodes"] = "one host per rank"
        if n_nodes is None and a.hint_nnodes:
            n_nodes = a.hint_nnodes
            self.evidence["n_nodes"] = "launcher line"
        n_ranks_min = max([n_ranks or 0, (max(a.ranks_seen) + 1) if a.ranks_seen else 0,
                           len(a.procs), len(a.nt_ranks)]) or None
        n_nodes_min = max([n_nodes or 0, len(hosts), 2 if (a.collnet_channels or a.collnet_agg) else 0,
                           max((s[1] for s in a.comm_shapes), default=0)]) or None
        return n_ranks, n_nodes, n_ranks_min, n_nodes_min, rank_hosts

    def _single_node_proof(self, n_ranks: int, rank_hosts: dict[int, str]) -> str | None:
        """Why every one of the n_ranks ranks runs on one node, or None when the text does not
        prove it (then the node count stays unknown: an excerpt never shows that no other exists)."""
        a = self.a
        if n_ranks > _MAX_KEYS:
            return None
        ranks = range(n_ranks)
        procs = [a.rank_procs.get(r) for r in ranks]
        if all(p is not None and len(p) == 1 for p in procs) and len(set().union(*procs)) == 1:
            return "one process drives every rank"
        if all(r in rank_hosts for r in ranks) and len({rank_hosts[r] for r in ranks}) == 1:
            return "every rank prints from one host"
        if len(a.hosts) == 1 and len(a.procs) >= n_ranks and not self._anonymous_hosts():
            # n_ranks ranks, and that many GPU processes print, all from one host
            return f"{len(a.procs)} GPU processes on one host for {n_ranks} ranks"
        if a.intra_edges and self._connected_by(a.intra_edges, n_ranks):
            return "P2P/SHM channel hops join every rank"
        if a.intra_edges and rank_hosts and len(set(rank_hosts.values())) == 1:
            # issue 26: ranks that print from one host share its node, and a P2P/SHM hop joins
            # two ranks of one node; together they may join all ranks (a rank that prints no
            # line of its own is reached by a P2P hop from one that does)
            anchor = next(iter(rank_hosts))
            same = {(r, anchor) for r in rank_hosts}
            if self._connected_by(a.intra_edges | same, n_ranks):
                return "P2P/SHM channel hops and one host join every rank"
        return None

    def _one_host_proof(self, hosts: set) -> str | None:
        """Single node without a rank count: every bootstrap interface is loopback (no peer on
        another host could connect), or one process drives every rank the text names (two or
        more, each printing or reached through "P2P/direct pointer"); GPUs alone do not count,
        one process per node may drive all of its node's GPUs."""
        a = self.a
        if len(hosts) != 1 or self._anonymous_hosts():
            return None
        if a.boot_scope == {"loopback"}:
            return "bootstrap over the loopback interface only"
        procs = {(h, p) for h, p, _d in a.procs}
        ranks = a.ranks_seen | set(a.rank_procs)
        if len(procs) == 1 and len(ranks) >= 2 and all(a.rank_procs.get(r) == procs for r in ranks):
            return "one process drives every rank shown"
        return None

    @staticmethod
    def _connected_by(edges: set[tuple], n_ranks: int) -> bool:
        """True when the intra-node hops (P2P, SHM: never between nodes) join ranks 0..n-1 into
        one group: then they all share a node."""
        parent = list(range(n_ranks))

        def root(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for src, dst in edges:
            if 0 <= src < n_ranks and 0 <= dst < n_ranks:
                parent[root(src)] = root(dst)
            else:
                return False            # a rank outside the communicator: another comm's lines
        r0 = root(0)
        return all(root(r) == r0 for r in range(n_ranks))

    # transport ---------------------------------------------------------------------------

    def _roce_evidence(self) -> list[str]:
        """Why the verbs path (NET/IB) runs over RoCE rather than InfiniBand."""
        a = self.a
        out = list(a.roce_evidence)
        out += [f"{k} set" for k in _ROCE_ENV if k in a.env and f"{k} set" not in out]
        return out

    def _link_layer_family(self, family: str) -> str:
        """NET/IB is the verbs path of InfiniBand and RoCE alike: ROCE when every listed HCA is
        RoCE, or, none listed, when a RoCE-only fact shows (IPv4-mapped GID, a GID index
        setting, an Ethernet link layer) and no InfiniBand link layer does."""
        if family != "IB":
            return family
        layers = set(self.a.ib_devs.values())
        used = self._used_layers()
        if used:
            self.evidence["link_layer"] = "NET/IB device of the channel lines"
            return "ROCE" if used == {"RoCE"} else "IB"
        if layers:
            return "ROCE" if layers == {"RoCE"} else "IB"
        if self._roce_evidence() and not self.a.ib_link_evidence:
            self.evidence["link_layer"] = "; ".join(self._roce_evidence())
            return "ROCE"
        return family

    def _used_layers(self) -> set[str]:
        """Link layers of the HCAs the channel lines use ("via NET/IB/2" is device [2] of the
        `NET/IB : Using [0]mlx5_0:1/IB ... [2]mlx5_2:1/RoCE` list); empty when an index is not
        in the list or the hosts' lists disagree (then an index names no one HCA)."""
        a = self.a
        if not a.net_devs_used or not a.ib_devs or a.ib_index_conflict:
            return set()
        by_index = {i: a.ib_devs[h] for h, i in a.ib_dev_index.items()}
        if len(by_index) != len(a.ib_dev_index) or not a.net_devs_used <= set(by_index):
            return set()
        return {by_index[i] for i in a.net_devs_used}

    def _mixed_layers(self) -> bool:
        """HCAs of both link layers listed and the channel lines do not say which one is used."""
        return set(self.a.ib_devs.values()) == {"IB", "RoCE"} and not self._used_layers()

    def _split_net(self, single_node: bool, rank_hosts: dict[int, str]):
        """NET channel aggregates -> (inter entries, intra entries)."""
        inter, intra = [], []
        for key, n in self.a.net_agg.items():
            host, me, peer, _dir, _net, _gdr, _proxy = key
            same = single_node or (host is not None and rank_hosts.get(peer) == host
                                   and rank_hosts.get(me) == host)
            (intra if same else inter).append((key, n))
        return inter, intra

    def _transport(self, single_node: bool, inter):
        a = self.a
        if single_node:
            self.evidence["inter_node_transport"] = "single node"
            if a.networks:
                return "NONE", max(a.networks, key=a.networks.get)
            # no RDMA device (or no libibverbs) and only NET/Socket listed: the net is Socket
            no_ib = a.ib_no_device or any(k[1] == "ibverbs_missing" for k in a.findings)
            return "NONE", ("Socket" if no_ib and a.net_socket_ifaces and not a.ib_devs else None)
        names: Counter = Counter()
        for key, n in inter:
            names[key[4]] += n
        for (net, _gdr), n in a.net_fragments.items():
            names[net] += n
        if names:
            fams = {_net_family(x) for x in names}
            fam = "SOCKET" if "SOCKET" in fams else (fams.pop() if len(fams) == 1 else "UNKNOWN")
            self.evidence["inter_node_transport"] = "channel lines"
            return self._link_layer_family(fam), names.most_common(1)[0][0]
        coll = Counter()
        for (_h, _r, net, _g), n in a.collnet_agg.items():
            coll[net] += n
        if coll:
            self.evidence["inter_node_transport"] = "CollNet channel lines"
            net = coll.most_common(1)[0][0]
            return self._link_layer_family(_net_family(net)), net
        if a.networks:
            net = max(a.networks, key=a.networks.get)
            fams = {_net_family(x) for x in a.networks}
            fam = "SOCKET" if "SOCKET" in fams else _net_family(net)
            self.evidence["inter_node_transport"] = "Using network line"
            return self._link_layer_family(fam), net
        src = [f for f in ("SOCKET", "IB", "OFI") if a.src_transports.get(f)]
        if src:
            # "transport/net_ib.cc:1295 NCCL WARN ..." / "net_socket.cc:NNN -> 2": the net
            # transport that was running (error excerpts often show nothing else)
            self.evidence["inter_node_transport"] = {
                "SOCKET": "source file transport/net_socket.cc", "IB": "source file transport/net_ib.cc",
                "OFI": "source file of aws-ofi-nccl"}[src[0]]
            return self._link_layer_family(src[0]), None
        if a.ib_error_seen:
            self.evidence["inter_node_transport"] = "IB completion errors"
            return self._link_layer_family("IB"), "IB"
        if a.ib_devs:
            self.evidence["inter_node_transport"] = "NET/IB device line"
            return self._link_layer_family("IB"), "IB"
        if a.ofi.get("provider") or a.ofi.get("version"):
            if not a.ofi.get("failures"):
                self.evidence["inter_node_transport"] = "NET/OFI plugin lines"
                return "OFI", "Libfabric"
        if a.net_socket_ifaces and not self._bootstrap_era_socket():
            self.evidence["inter_node_transport"] = "NET/Socket device line"
            return "SOCKET", "Socket"
        absent = self._ib_absent()
        if a.net_socket_ifaces and absent:
            # any version: NCCL initialises its socket transport for data only when no net
            # plugin and no verbs device is usable ("No device found", libibverbs missing,
            # NCCL_IB_DISABLE=1); before 2.7 the same line alone may name the bootstrap's
            # interface, so it decides only with that proof
            self.evidence["inter_node_transport"] = f"NET/Socket device line after {absent}"
            return "SOCKET", "Socket"
        self.evidence["inter_node_transport"] = None
        return "UNKNOWN", None

    def _ib_absent(self) -> str | None:
        """Why no verbs device (and no working net plugin) can carry the data, or None."""
        a = self.a
        if a.ib_devs or a.networks or (a.ofi.get("provider") and not a.ofi.get("failures")):
            return None
        if a.env.get("NCCL_IB_DISABLE") == "1":
            return "NCCL_IB_DISABLE=1"
        if a.ib_no_device:
            return "NET/IB : No device found"
        if any(k[1] == "ibverbs_missing" for k in a.findings):
            return "libibverbs missing"
        return None

    def _bootstrap_era_socket(self) -> bool:
        """Before NCCL 2.7 'NET/Socket : Using' also named the bootstrap interface."""
        v = self._version_tuple()
        return v is not None and v < (2, 7)

    def _version_tuple(self) -> tuple[int, int] | None:
        if not self.a.versions:
            return None
        m = re.match(r"(\d+)\.(\d+)", max(self.a.versions, key=lambda v: len(self.a.versions[v])))
        return (int(m.group(1)), int(m.group(2))) if m else None

    def _gdr(self, transport: str, network: str | None, inter, intra):
        """gdr, asymmetric, by_host, by_rank."""
        a = self.a
        entries = inter or intra
        by_host: dict[str, set] = {}
        by_rank: dict[str, set] = {}
        flags: set[bool] = set()
        for key, _n in entries:
            host, me, _peer, direction, _net, gdr, _proxy = key
            flags.add(gdr)
            by_host.setdefault(host or "?", set()).add(gdr)
            if len(by_rank) < 4096:
                by_rank.setdefault(f"{host or '?'}/{me}", set()).add(gdr)
        if not entries:
            for (_net, gdr), _n in a.net_fragments.items():
                flags.add(gdr)
            for (host, rank, _net, gdr), _n in a.collnet_agg.items():
                flags.add(gdr)
                by_host.setdefault(host or "?", set()).add(gdr)
        asym = _asymmetric(by_host)
        if flags:
            self.evidence["gdr"] = "channel lines"
            gdr = flags == {True}
            return gdr, asym, _flatten(by_host), _flatten(by_rank), len(flags) > 1
        if transport == "SOCKET" or (network and _net_family(network) == "SOCKET"):
            self.evidence["gdr"] = "network is Socket"
            return False, False, {}, {}, False
        if transport == "OFI" and a.ofi.get("hmem") is False:
            self.evidence["gdr"] = "libfabric: FI_HMEM not supported by the device"
            return False, False, {}, {}, False
        if a.rings_gdr and transport != "NONE":
            per_host: dict[str, set] = {}
            vals: set[int] = set()
            for (host, _pid), gs in a.rings_gdr.items():
                vals |= gs
                per_host.setdefault(host or "?", set()).update(bool(g) for g in gs)
            self.evidence["gdr"] = "Connected all rings ... GDR line"
            return vals == {1}, _asymmetric(per_host), _flatten(per_host), {}, len(vals) > 1
        if a.gdr_gpu and transport != "NONE":
            self.evidence["gdr"] = "GPU Direct RDMA per-GPU lines"
            return set(a.gdr_gpu) == {"Enabled"}, False, {}, {}, len(a.gdr_gpu) > 1
        if a.gdr_hca and set(a.gdr_hca.values()) == {"Disabled"} and transport != "NONE":
            self.evidence["gdr"] = "GPU Direct RDMA Disabled for HCA lines"
            return False, False, {}, {}, False
        self.evidence["gdr"] = None
        return None, False, {}, {}, False

    # versions ------------------------------------------------------------------------------

    def _versions(self):
        a = self.a
        versions = sorted(a.versions, key=lambda v: (-len(a.versions[v]), v))
        version = versions[0] if versions else None
        if version is None and a.version_hint:
            version = a.version_hint
            self.evidence["nccl_version"] = "vLLM 'using nccl==' line"
        elif version:
            self.evidence["nccl_version"] = "NCCL version line"
        mismatch = len({v.split("+")[0] for v in versions}) > 1
        explicit: dict[str, tuple[int, int]] = {}
        for v, hosts in a.versions.items():
            mm = re.match(r"(\d+)\.(\d+)", v)
            for h in hosts:
                if h is not None and mm:
                    explicit[h] = (int(mm.group(1)), int(mm.group(2)))
        ranges = []
        for host, (lo, hi) in a.eras.items():
            if host in explicit:
                ranges.append((host, explicit[host], explicit[host]))
            else:
                ranges.append((host, lo or (0, 0), hi or (99, 99)))
        for h, v in explicit.items():
            if h not in a.eras:
                ranges.append((h, v, v))
        for i, (h1, lo1, hi1) in enumerate(ranges):
            for h2, lo2, hi2 in ranges[i + 1:]:
                if hi1 < lo2 or hi2 < lo1:
                    mismatch = True
                    self.notes.append(
                        f"NCCL on {h1} ({_version_key(lo1)}..{_version_key(hi1)}) and on {h2} "
                        f"({_version_key(lo2)}..{_version_key(hi2)}) print different message formats: "
                        "different NCCL builds")
                    break
            if mismatch and len(self.notes) > 0:
                break
        return version, tuple(versions), mismatch

    # findings ------------------------------------------------------------------------------

    def _log_findings(self):
        a = self.a
        errors, warnings = [], []
        for (severity, kind, _norm), (msg, line, n, hosts) in a.findings.items():
            f = Finding(kind, severity, msg, line, n, tuple(sorted(h for h in hosts if h)))
            (errors if severity == "error" else warnings).append(f)
        stacks: dict[tuple, list] = {}          # (severity, code) -> [line, n, hosts]
        for (code, plugin, proc), (line, n, files) in a.trace_errors.items():
            if plugin:
                if not a.ofi.get("failures"):
                    self.notes.append(f"a net plugin failed to load or initialise ({line}); "
                                      "NCCL fell back to another network")
                continue
            key = (self._stack_severity(proc, files), code)
            rec = stacks.setdefault(key, [line, 0, set()])
            rec[1] += n
            if proc[0]:
                rec[2].add(proc[0])
        for (severity, code), (line, n, hosts) in stacks.items():
            name = _NCCL_RESULT.get(code, str(code))
            if severity == "error":
                errors.append(Finding("nccl_call_failed", "error",
                                      f"an NCCL call returned {code} ({name})", line, n,
                                      tuple(sorted(hosts))))
            else:
                warnings.append(Finding("nccl_call_recovered", "warning",
                                        f"an NCCL call returned {code} ({name}) and NCCL went on "
                                        "(an optional path or probe failed and fell back)", line, n,
                                        tuple(sorted(hosts))))
        if a.findings_dropped:
            self.notes.append(f"{a.findings_dropped} more WARN/error lines of other kinds not listed")
        return tuple(errors), tuple(warnings)

    def _stack_severity(self, proc: tuple, files: set) -> str:
        """A failed call's stack ("file.cc:NNN -> N") is an error unless the failure was
        recovered: the process went on to finish init (Init COMPLETE, Connected all rings,
        Init timings, the channel summary) with no error WARN of its own and the application
        reported no NCCL failure (a communicator's "Abort COMPLETE" alone is not one: PyTorch
        aborts its communicators at shutdown); an old
        GPUDirect probe (include/net.h alone) followed by channel set-up is recovered too. A
        stack with no such sign is an init that never completed."""
        a = self.a
        known = proc[0] is not None
        if a.aborted or (proc in a.warn_err_procs if known else bool(a.warn_err_procs)):
            return "error"
        done = proc in a.done_procs if known else bool(a.done_procs)
        if done:
            return "warning"
        if files <= _PROBE_FRAMES and (a.chan_procs or a.done_procs):
            return "warning"            # the same probe on every rank; the rings were set up
        return "error"

    def _incomplete(self):
        a = self.a
        done = {(h, p, c, r) for (h, p, c, r, _n) in a.init_complete}
        out = []
        for h, p, c, r, nr in sorted(a.init_start - a.init_complete, key=lambda k: (str(k[0]), k[3])):
            if (h, p, c, r) not in done:
                out.append({"host": h, "pid": p, "comm": c, "rank": r, "nranks": nr})
        return tuple(out[:256])

    def _nccl_tests(self):
        a = self.a
        if not a.nt_seen:
            return None, None
        rows = []
        for (size, dtype, redop), (count, root, oop, ip, wrong) in sorted(a.nt_rows.items()):
            rows.append({"size_bytes": size, "count": count, "type": dtype, "redop": redop,
                         "root": root, "time_us_oop": oop[0], "algbw_gbps_oop": oop[1],
                         "busbw_gbps_oop": oop[2],
                         "time_us_ip": ip[0] if ip else None, "algbw_gbps_ip": ip[1] if ip else None,
                         "busbw_gbps_ip": ip[2] if ip else None, "wrong": wrong})
        avgs = list(a.nt_avgs)
        avg = avgs[-1] if avgs else None
        table = {
            "collective": a.nt_collective,
            "rows": rows,
            "max_size_bytes": max((r["size_bytes"] for r in rows), default=None),
            "peak_busbw_gbps_oop": max((r["busbw_gbps_oop"] for r in rows), default=None),
            "peak_busbw_gbps_ip": max((r["busbw_gbps_ip"] for r in rows
                                       if r["busbw_gbps_ip"] is not None), default=None),
            "avg_busbw_gbps": avg,
            "avg_busbw_gbps_all": avgs,
            "wrong": sum(r["wrong"] for r in rows),
            "out_of_bounds": a.nt_oob,
            "ranks": {str(k): v for k, v in sorted(a.nt_ranks.items())[:4096]},
        }
        return table, avg

    # all together --------------------------------------------------------------------------

    def build(self) -> NcclLog:
        a = self.a
        n_ranks, n_nodes, n_ranks_min, n_nodes_min, rank_hosts = self._ranks_and_nodes()
        single_node = n_nodes == 1
        inter, intra = self._split_net(single_node, rank_hosts)
        transport, network = self._transport(single_node, inter)
        gdr, asym, gdr_by_host, gdr_by_rank, gdr_mixed = self._gdr(transport, network, inter, intra)

        intra_set = set(a.intra)
        if intra:
            intra_set.add("NET")
        for fam in ("SHM", "NVLS"):     # transport/shm.cc, nvls.cc in a WARN or a failed call's stack
            if a.src_transports.get(fam):
                intra_set.add(fam)
        if a.nvls:
            intra_set.add("NVLS")
        intra_t = tuple(t for t in INTRA_NODE_TRANSPORTS if t in intra_set)

        version, versions, mismatch = self._versions()
        errors, warnings = self._log_findings()
        if transport == "OFI":          # the OFI plugin carries the traffic: its WARNs are failures
            ofi = tuple(replace(w, kind="ofi_failure", severity="error") for w in warnings
                        if w.kind == "plugin_failure" and w.message.startswith("NET/OFI"))
            if ofi:
                warnings = tuple(w for w in warnings
                                 if not (w.kind == "plugin_failure" and w.message.startswith("NET/OFI")))
                errors = errors + ofi
        incomplete = self._incomplete()
        nccl_tests, busbw = self._nccl_tests()
        # in device-list order ([0], [1], ...; 2.3 prints one device per line, in any order)
        ib_hcas = tuple(sorted(a.ib_devs, key=lambda h: a.ib_dev_index.get(h, 1 << 30))) or tuple(a.warn_hcas)
        link_layers = tuple(sorted(set(a.ib_devs.values())))
        if not link_layers and transport == "ROCE":
            link_layers = ("RoCE",)             # shown by a GID, a GID-index setting, a link layer line
        elif not link_layers and transport == "IB" and a.ib_link_evidence:
            link_layers = ("IB",)
        pxn = any(k[6] for k, _ in inter) or 1 in a.rings_pxn

        comms = tuple({"n_ranks": s[0], "n_nodes": s[1], "local_ranks": s[2], "count": c}
                      for s, c in sorted(a.comm_shapes.items(),
                                         key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)))
        net_plugin = None
        if a.plugin or a.ofi:
            net_plugin = dict(a.plugin)
            if a.ofi:
                net_plugin["ofi"] = {k: v for k, v in a.ofi.items() if k != "seen"}
            net_plugin["used"] = network
            if a.ofi.get("failures") and network and _net_family(network) != "OFI":
                self.notes.append(f"the OFI (aws-ofi-nccl) plugin did not work here "
                                  f"({a.ofi['failures']}); NCCL used {network}")
        if a.truncated:
            self.notes.append(f"{a.truncated} line(s) longer than {LINE_MAX} characters: only their "
                              "first part was read")
        if a.net_socket_ifaces and set(a.net_socket_ifaces) <= {"lo"}:
            self.notes.append("NET/Socket uses only the loopback interface (lo): no rank can reach "
                              "another host over it")
        if a.env.get("NCCL_P2P_DISABLE") == "1":
            self.notes.append("NCCL_P2P_DISABLE=1: intra-node traffic cannot use NVLink/PCIe P2P")
        if a.env.get("NCCL_IB_DISABLE") == "1":
            self.notes.append("NCCL_IB_DISABLE=1: InfiniBand/RoCE verbs are switched off")
        local = max((s[2] for s in a.comm_shapes if s[2]), default=None)
        if transport in ("IB", "ROCE") and local and len(ib_hcas) == 1 and local > 1:
            self.notes.append(f"one HCA ({ib_hcas[0]}) carries the inter-node traffic of "
                              f"{local} local ranks" + (" through PXN" if pxn else ""))
        if a.gdr_hca and "Disabled" in a.gdr_hca.values():
            self.notes.append("GPU Direct RDMA Disabled for HCA "
                              + ", ".join(h for h, s in a.gdr_hca.items() if s == "Disabled")
                              + ": check nvidia_peermem / nv_peer_mem")

        socket_ifaces = tuple(a.socket_ifaces)
        return NcclLog(
            nccl_version=version, nccl_versions=versions, version_mismatch_suspected=mismatch,
            n_ranks=n_ranks, n_ranks_min=n_ranks_min, n_nodes=n_nodes, n_nodes_min=n_nodes_min,
            inter_node_transport=transport, network=network, gdr=gdr, gdr_asymmetric=asym,
            gdr_by_host=gdr_by_host, gdr_by_rank=gdr_by_rank, intra_node_transports=intra_t,
            channel_counts=dict(sorted(a.chan_counts.items())), ib_hcas=ib_hcas,
            link_layers=link_layers, link_layer_evidence=self._link_evidence(transport),
            source_transports=dict(sorted(a.src_transports.items())), socket_ifaces=socket_ifaces,
            bootstrap_ifaces=tuple(a.boot_ifaces), net_plugin=net_plugin,
            collnet=bool(a.collnet_channels or a.collnet_agg), nvls=a.nvls, pxn=pxn,
            hosts=tuple(sorted(a.hosts))[:4096], ray_node_ips=tuple(sorted(a.ray_ips))[:4096],
            ranks_incomplete=incomplete, communicators=comms, errors=errors, warnings=warnings,
            notes=tuple(dict.fromkeys(self.notes)),
            nccl_tests=nccl_tests, busbw_gbps=busbw, env=dict(a.env),
            cuda_driver_version=a.cuda_driver, evidence=dict(self.evidence), lines=a.lines,
            nccl_lines=a.nccl_lines, lines_truncated=a.truncated,
            net_socket_ifaces=tuple(a.net_socket_ifaces), ofi_provider=a.ofi.get("provider"),
            link_layers_mixed=self._mixed_layers(), gdr_mixed=gdr_mixed)

    def _link_evidence(self, transport: str) -> tuple[str, ...]:
        """Why the verbs path is RoCE or InfiniBand (device lines first)."""
        a = self.a
        layers = sorted(set(a.ib_devs.values()))
        out = [f"NET/IB device line: {'/'.join(layers)}"] if layers else []
        return tuple(out + self._roce_evidence() + list(a.ib_link_evidence))


_GENERIC_HOSTS = frozenset(("localhost", "hostname", "host", "node", "server", "machine"))


def _generic_host(host: str) -> bool:
    """A host name a poster redacted ("xxx", "***", "<cluster_name>") or one that every machine
    may carry (localhost): it does not tell machines apart."""
    low = host.lower()
    return (low in _GENERIC_HOSTS or not low.strip("x*#?._-") or low[:1] in "<[{("
            or low[-1:] in ">]})")


def _uint(text: str) -> bool:
    """ASCII digits only (str.isdigit() also takes '²' and '١', which int() refuses or misreads)."""
    return text.isascii() and text.isdigit()


def _finite(text: str) -> float | None:
    """A finite float from ASCII digits ("1.5", "2e3"), else None (no 'nan', 'inf', '1e400', '١')."""
    if not text.isascii() or text.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _flatten(by: dict[str, set]) -> dict[str, Any]:
    return {k: (next(iter(v)) if len(v) == 1 else "mixed") for k, v in sorted(by.items())}


def _asymmetric(by_host: dict[str, set]) -> bool:
    """GDR on every channel of one host and on none of another's."""
    known = {h: v for h, v in by_host.items() if h != "?"}
    return any(v == {True} for v in known.values()) and any(v == {False} for v in known.values())


# ---------------------------------------------------------------------------------------------
# Entry points


def parse(text: str | bytes) -> NcclLog:
    """Parse an NCCL log held in memory (read as a stream of lines, like parse_file)."""
    if not isinstance(text, (str, bytes)):
        raise ParseError(KIND, f"expected text, got {type(text).__name__}")
    if not text.strip():
        raise ParseError(KIND, "empty input")
    acc = NcclLogAccumulator()
    acc.feed_stream(_line_stream(text))
    return acc.result()


def parse_texts(texts: Iterable[str]) -> NcclLog:
    """Several logs (each rank's NCCL_DEBUG text) read as one: hosts and ranks are told apart
    by their envelopes. A text without a final newline still ends its last line."""
    acc = NcclLogAccumulator()
    for text in texts:
        acc.feed_text(text if text.endswith("\n") else text + "\n")
    return acc.result()


def parse_lines(lines: Iterable[str | bytes]) -> NcclLog:
    """Parse an iterable of lines (with or without newlines), e.g. an open text file."""
    acc = NcclLogAccumulator()
    acc.feed_lines(lines)
    return acc.result()


def parse_file(path: str | os.PathLike) -> NcclLog:
    """Stream a log file line by line; memory stays flat whatever its size.

    The file is iterated in C (binary, buffered) straight into the accumulator's counting
    window, `_FILE_BATCH` lines at a time, so no Python code runs per raw line.
    """
    acc = NcclLogAccumulator()
    with open(path, "rb", buffering=0) as f:      # BLOCK_BYTES reads: no second buffer copy
        acc.feed_stream(f)
    return acc.result()


def _line_stream(text: bytes | str) -> io.BytesIO | io.StringIO:
    """An in-memory stream over the text that yields its lines as written (no newline
    translation; BytesIO shares a bytes object's buffer)."""
    return io.StringIO(text, newline="\n") if isinstance(text, str) else io.BytesIO(text)


def _read_block(f: Any) -> bytes | str:
    """BLOCK_BYTES of the stream, or what is left of it: short reads (a pipe, a FIFO) are joined
    into one block, so the carried chunk is not searched again after every few bytes."""
    block = f.read(BLOCK_BYTES)
    if not block or len(block) >= BLOCK_BYTES:
        return block
    parts, size = [block], len(block)
    while size < BLOCK_BYTES:
        more = f.read(BLOCK_BYTES - size)
        if not more:
            break
        parts.append(more)
        size += len(more)
    return block[:0].join(parts)


_DETECT_RE = re.compile(r"(?m)^\W{0,8}(?:\S+\s+)?NCCL version \d+\.\d+\.\d+|"
                        r"\] \S+:\d+ (?:NCCL )?WARN |#\s*Avg bus bandwidth\s*:")


def detect(text: str) -> bool:
    """True for NCCL_DEBUG output, a bare NCCL version line, nccl-tests results or NCCL failures."""
    if not isinstance(text, str):
        return False
    if "NCCL INFO" in text or "NCCL WARN" in text or "NCCL TRACE" in text:
        return True
    if _DETECT_RE.search(text):
        return True
    if "busbw" in text and "algbw" in text:
        return True
    if "ProcessGroupNCCL" in text and ("Watchdog" in text or "NCCL error" in text):
        return True
    return "NCCL failure" in text or "ncclSystemError" in text
