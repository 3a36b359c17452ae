"""Remediation plans (issue 13), pure: a node's preflight results and facts -> the steps that fix
what failed, or why no safe automatic fix exists.

A fixer is pyinfra's operation: it reads facts and yields commands, or nothing when the check
already passes (idempotence: a converged node plans no step). Files a step writes are named in
`writes` so the executor records their content before the change (the undo record); a mount
it changes is named in `remounts`; a step whose change Ray sees only after a restart says so in
`restarts_ray`. Nothing here runs a command: the executor writes every file through the
fix_files node program (playbooks/fix.py).

    gpudirect      modprobe the peer-memory module, persist it in /etc/modules-load.d
    clock          enable the time daemon, step the clock (a node running Ray: only with --yes)
    shm            remount /dev/shm at the expected size, persist it in /etc/fstab (container: manual)
    memlock        limits.d + a systemd default; a running Ray keeps its old limit (restart named)
    persistence    nvidia-smi -pm 1 (+ nvidia-persistenced when present)
    fabricmanager  enable and start nvidia-fabricmanager
    versions       pip install the reference versions into ray.python (only with --checks versions)
    model          copy the missing or differing model files from the reference node, node to
                   node (only with --checks model; the copy itself is playbooks/fix_model.py)
    anything else  manual: the reason and the next diagnostic step
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from cluster.inspection.node_summary import NodeFactsSummary
from cluster.nodes.inventory import Inventory, Node
from cluster.remedy.model_sync import reference_node
from cluster.base.results import CheckResult, Status
from cluster.nodes.shell import as_root_command

MODULES_LOAD_FILE = "/etc/modules-load.d/cluster-peermem.conf"
LIMITS_FILE = "/etc/security/limits.d/90-cluster-memlock.conf"
SYSTEMD_LIMITS_FILE = "/etc/systemd/system.conf.d/90-cluster-memlock.conf"
FSTAB = "/etc/fstab"
# pam_limits never applies `*` to root: root needs its own lines (limits.conf(5)).
LIMITS_TEXT = "# written by `cluster fix` (memlock for RDMA)\n" \
              "* soft memlock unlimited\n* hard memlock unlimited\n" \
              "root soft memlock unlimited\nroot hard memlock unlimited\n"
SYSTEMD_LIMITS_TEXT = "# written by `cluster fix` (memlock for RDMA)\n" \
                      "[Manager]\nDefaultLimitMEMLOCK=infinity\n"
# Run only when named in --checks: they change software or copy data, not node settings.
OPT_IN = frozenset({"versions", "model"})


@dataclass(frozen=True)
class FileWrite:
    """A whole file the step writes; `content` None: computed from the file's current text."""

    path: str
    content: str | None = None
    edit: Callable[[str], str] | None = field(default=None, compare=False)

    def new_text(self, current: str | None) -> str:
        if self.content is not None:
            return self.content
        return self.edit(current or "")


@dataclass(frozen=True)
class Step:
    """One fix on one node: commands to run (as root), files to write, then re-check `check`."""

    node: str
    check: str
    action: str                       # what it does, one line
    commands: tuple[str, ...] = ()
    writes: tuple[FileWrite, ...] = ()
    remounts: tuple[str, ...] = ()     # mount points whose options it changes
    note: str | None = None            # what the admin must still know (e.g. restart Ray)
    restarts_ray: bool = False         # Ray on the node must restart for the fix to take hold
    manual_exit: tuple[int, str, str] | None = None   # (exit code, reason, next step): manual
    source: str | None = None          # model: the node that holds the reference copy
    as_root: bool = True               # False: its commands run as the SSH user (they start
    #                                    an interpreter a non-root user may change: never root)


@dataclass(frozen=True)
class Manual:
    """A failed check with no safe automatic fix: why, and what to look at next."""

    node: str | None
    check: str
    reason: str
    next_step: str


@dataclass(frozen=True)
class Skipped:
    node: str | None
    check: str
    reason: str


@dataclass(frozen=True)
class FixPlan:
    steps: tuple[Step, ...]
    manual: tuple[Manual, ...]
    skipped: tuple[Skipped, ...]
    ok: tuple[tuple[str | None, str], ...]      # (node, check) that need nothing

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(s.node for s in self.steps))


@dataclass(frozen=True)
class FixContext:
    node: Node
    inventory: Inventory
    result: CheckResult
    facts: NodeFactsSummary      # what the node's checks reported (the preflight's facts)
    yes: bool


# ---------------------------------------------------------------- fixers


def fix_gpudirect(ctx: FixContext) -> Step | Manual:
    if ctx.facts.peermem_loaded:
        return Manual(ctx.node.name, "gpudirect",
                      "the peer-memory module is loaded but not registered with the RDMA stack",
                      "reload it after MLNX/DOCA OFED (`rmmod nvidia_peermem; modprobe "
                      "nvidia_peermem`) and check that it matches the driver (`modinfo "
                      "nvidia_peermem`, dmesg)")
    return Step(ctx.node.name, "gpudirect",
                "load nvidia_peermem (nv_peer_mem on old stacks) and load it at boot",
                ("modprobe nvidia_peermem 2>/dev/null || modprobe nv_peer_mem",),
                (FileWrite(MODULES_LOAD_FILE, None, _modules_load_edit),))


def _modules_load_edit(current: str) -> str:
    """The module list, nvidia_peermem added once (idempotent)."""
    lines = [ln for ln in current.splitlines() if ln.strip()]
    if "nvidia_peermem" not in (ln.strip() for ln in lines):
        lines.append("nvidia_peermem")
    return "\n".join(lines) + "\n"


def fix_clock(ctx: FixContext) -> Step | Manual | Skipped:
    source = ctx.facts.clock_source
    ray = bool(ctx.facts.ray_running)
    if source in (None, "chronyc tracking"):
        enable = ("systemctl is-active --quiet chrony chronyd || systemctl enable --now chrony "
                  "2>/dev/null || systemctl enable --now chronyd")
        step_cmd = "chronyc makestep"
    elif source == "timedatectl":
        enable = "timedatectl set-ntp true"
        step_cmd = "systemctl restart systemd-timesyncd"
    else:
        return Manual(ctx.node.name, "clock", f"the node syncs with {source} (ntpd)",
                      "step it with `ntpdate -u SERVER` or `ntpd -gq`, or move to chrony")
    if ray and not ctx.yes:
        return Skipped(ctx.node.name, "clock",
                       "Ray is running here: a clock step under running work needs --yes")
    return Step(ctx.node.name, "clock", "enable the time daemon and step the clock",
                (enable, step_cmd),
                note="clock stepped while Ray runs" if ray else None)


def _shm_size(ctx: FixContext) -> int:
    want = int(ctx.inventory.expectations["shm_min_bytes"])
    mib = 1 << 20
    return max(mib, math.ceil(want / mib) * mib)


IN_CONTAINER_EXIT = 42


def fix_shm(ctx: FixContext) -> Step:
    """Remount; a remount refused inside a container (docker/podman markers) is manual."""
    size = _shm_size(ctx)
    remount = (f"mount -o remount,size={size} /dev/shm || {{ if [ -f /.dockerenv ] || "
               f"[ -f /run/.containerenv ]; then exit {IN_CONTAINER_EXIT}; else exit 1; fi; }}")
    return Step(ctx.node.name, "shm", f"remount /dev/shm at {size >> 20} MiB and keep it in "
                                      f"/etc/fstab",
                (remount,),
                (FileWrite(FSTAB, None, lambda text: fstab_with_shm(text, size)),),
                remounts=("/dev/shm",),
                manual_exit=(IN_CONTAINER_EXIT,
                             "the node is a container: its /dev/shm is set by the runtime",
                             "restart it with `--shm-size` (docker/podman) or an emptyDir "
                             "medium: Memory (Kubernetes)"))


def fstab_with_shm(text: str, size: int) -> str:
    """/etc/fstab with one tmpfs /dev/shm line of `size` bytes (others kept, idempotent)."""
    line = f"tmpfs /dev/shm tmpfs defaults,nosuid,nodev,size={size} 0 0"
    kept = [ln for ln in text.splitlines()
            if not (ln.split()[1:2] == ["/dev/shm"] and not ln.lstrip().startswith("#"))]
    return "\n".join(kept + [line]) + "\n"


def fix_memlock(ctx: FixContext) -> Step:
    ray = bool(ctx.facts.ray_running)
    return Step(ctx.node.name, "memlock", "memlock unlimited for new sessions and services",
                (), (FileWrite(LIMITS_FILE, LIMITS_TEXT),
                     FileWrite(SYSTEMD_LIMITS_FILE, SYSTEMD_LIMITS_TEXT)),
                note=("Ray keeps its old limit until restarted on this node "
                      "(`cluster down` + `cluster up`, or `cluster restart-node`)") if ray
                else None, restarts_ray=ray)


def fix_persistence(ctx: FixContext) -> Step:
    return Step(ctx.node.name, "persistence", "persistence mode on (and at boot)",
                ("nvidia-smi -pm 1",
                 "! command -v nvidia-persistenced >/dev/null || systemctl enable "
                 "nvidia-persistenced 2>/dev/null || true"))


def fix_fabricmanager(ctx: FixContext) -> Step | Manual:
    if "not running" not in ctx.result.summary:
        return Manual(ctx.node.name, "fabricmanager", "fabric manager runs but the fabric is "
                                                        "not registered",
                      "`journalctl -u nvidia-fabricmanager`, `nvidia-smi -q | grep -A12 "
                      "Fabric`; the fabric manager version must equal the driver's")
    return Step(ctx.node.name, "fabricmanager", "enable and start nvidia-fabricmanager",
                ("systemctl enable --now nvidia-fabricmanager",))


def fix_versions(ctx: FixContext, reference: Mapping[str, str]) -> Step | Manual:
    pins = {"ray": "ray[serve]", "vllm": "vllm", "torch": "torch"}
    wanted = [f"{pins[c]}=={v}" for c, v in sorted(reference.items())
              if c in pins and v and ctx.facts.version(c) != v]
    if not wanted:
        return Manual(ctx.node.name, "versions", "the difference is not in ray, vllm or torch",
                      "align Python / NCCL by hand (the same image on every node)")
    pip = shlex.join([ctx.inventory.ray.python, "-m", "pip", "install", "--no-input", *wanted])
    return Step(ctx.node.name, "versions", "install the reference versions: " + " ".join(wanted),
                (as_interpreter_owner(ctx.inventory.ray.python, pip),), as_root=False)


def as_interpreter_owner(python: str, command: str) -> str:
    """`command` (it starts `python`, whose site-packages its owner may change: a .pth there
    runs at startup) as the owner of python's directory, never as root: the SSH user when it
    is the owner, else `sudo -n -u OWNER`; refused when that owner is root and the SSH user is
    not (pip into root's interpreter is the admin's call, by hand)."""
    py = shlex.quote(python)
    return (f"p=$(command -v -- {py}) || {{ echo {shlex.quote(python + ' not found')} >&2; "
            "exit 127; }; o=$(stat -c %U -- \"$(dirname -- \"$p\")\") || exit 1; "
            "if [ \"$o\" = \"$(id -un)\" ]; then " + command + "; "
            "elif [ \"$o\" = root ]; then echo \"$p belongs to root: install as root by hand "
            "\" >&2; exit 1; else sudo -n -u \"$o\" -- " + command + "; fi")


@dataclass(frozen=True)
class Fixer:
    """A check's fixer and what its steps may change: the whole files it writes and the mount
    points it remounts. The one declaration of those paths: plan_fixes refuses a step that
    writes anything else, and `cluster fix --undo` restores nothing else."""

    check: str
    plan: Callable[[FixContext], Any]
    files: tuple[str, ...] = ()
    mounts: tuple[str, ...] = ()


_FIXERS = (Fixer("gpudirect", fix_gpudirect, files=(MODULES_LOAD_FILE,)),
           Fixer("clock", fix_clock),
           Fixer("shm", fix_shm, files=(FSTAB,), mounts=("/dev/shm",)),
           Fixer("memlock", fix_memlock, files=(LIMITS_FILE, SYSTEMD_LIMITS_FILE)),
           Fixer("persistence", fix_persistence),
           Fixer("fabricmanager", fix_fabricmanager))
FIXERS: dict[str, Callable[[FixContext], Any]] = {f.check: f.plan for f in _FIXERS}
FIXABLE = frozenset(FIXERS) | OPT_IN
# check -> the files / mount points its fix owns (what undo may restore)
OWNED_FILES: dict[str, frozenset[str]] = {f.check: frozenset(f.files) for f in _FIXERS}
OWNED_MOUNTS: dict[str, frozenset[str]] = {f.check: frozenset(f.mounts) for f in _FIXERS}


def _owned(step: Step) -> Step:
    """The step, when it writes and remounts only what its check's fixer declares."""
    files, mounts = OWNED_FILES.get(step.check, frozenset()), OWNED_MOUNTS.get(step.check,
                                                                              frozenset())
    stray = [w.path for w in step.writes if w.path not in files] + \
        [m for m in step.remounts if m not in mounts]
    if stray:
        raise ValueError(f"the {step.check} fix would change {', '.join(stray)}, which its "
                         f"Fixer does not declare")
    return step


def _needs_fix(result: CheckResult) -> bool:
    return result.status in (Status.FAIL, Status.WARN, Status.ERROR)


def _reference_versions(facts: Mapping[str, NodeFactsSummary], head: str) -> dict[str, str]:
    return dict((facts.get(head) or NodeFactsSummary()).versions or {})


def _version_results(results: Sequence[CheckResult]) -> dict[str, list[CheckResult]]:
    """Per node, its failing `*-match` version results (ray-match, vllm-match ...)."""
    out: dict[str, list[CheckResult]] = {}
    for r in results:
        if r.node and r.check.endswith("-match") and r.check[:-6] in ("ray", "vllm", "torch") \
                and _needs_fix(r):
            out.setdefault(r.node, []).append(r)
    return out


def plan_fixes(results: Sequence[CheckResult], facts: Mapping[str, NodeFactsSummary],
               inventory: Inventory, chosen: frozenset[str] | None, yes: bool) -> FixPlan:
    """Pure: preflight results and facts -> the steps, manual items, skips and oks.

    `chosen`: the check ids of --checks (None: every check except the opt-in ones).
    """
    nodes = {n.name: n for n in inventory.nodes}
    steps: list[Step] = []
    manual: list[Manual] = []
    skipped: list[Skipped] = []
    ok: list[tuple[str | None, str]] = []
    version_fails = _version_results(results)
    model_fails = _model_results(results)
    for r in results:
        if r.check.endswith("-match") and r.check[:-6] in ("ray", "vllm", "torch", "python",
                                                           "nccl", "model"):
            continue                                 # handled as `versions` / `model` below
        if r.check == "model" and r.node is not None and r.status is not Status.ERROR:
            if not _needs_fix(r) and r.node not in model_fails and \
                    (chosen is None or "model" in chosen):
                ok.append((r.node, r.check))
            continue                                          # failures: `model` below
        if chosen is not None and r.check not in chosen:
            continue
        if not _needs_fix(r):
            ok.append((r.node, r.check))
            continue
        if r.node is None:
            manual.append(Manual(None, r.check, f"a cross-node result: {r.summary}",
                                 r.fix or "see the per-node results"))
            continue
        if r.status is Status.ERROR and r.summary.startswith(("unreachable", "timeout")):
            skipped.append(Skipped(r.node, r.check, r.summary))
            continue
        if r.check in OPT_IN and (chosen is None or r.check not in chosen):
            skipped.append(Skipped(r.node, r.check, f"opt-in: name it in --checks {r.check}"))
            continue
        fixer = FIXERS.get(r.check)
        if fixer is None:
            manual.append(Manual(r.node, r.check, f"no safe automatic fix: {r.summary}",
                                 r.fix or "see the check's evidence (`--json`)"))
            continue
        ctx = FixContext(nodes[r.node], inventory, r, facts.get(r.node) or NodeFactsSummary(),
                         yes)
        outcome = fixer(ctx)
        if isinstance(outcome, Step):
            _owned(outcome)
        (steps if isinstance(outcome, Step) else
         manual if isinstance(outcome, Manual) else skipped).append(outcome)
    if version_fails:
        if chosen is not None and "versions" in chosen:
            reference = _reference_versions(facts, inventory.head.name)
            for node, _ in version_fails.items():
                ctx = FixContext(nodes[node], inventory, version_fails[node][0],
                                 facts.get(node) or NodeFactsSummary(), yes)
                outcome = fix_versions(ctx, reference)
                (steps if isinstance(outcome, Step) else manual).append(outcome)
        else:
            for node in version_fails:
                skipped.append(Skipped(node, "versions",
                                       "version skew: name it in --checks versions to pip "
                                       "install the head's versions"))
    if model_fails:
        if chosen is not None and "model" in chosen:
            for outcome in plan_model(model_fails, facts, inventory):
                (steps if isinstance(outcome, Step) else manual).append(outcome)
        elif chosen is None:
            for node in model_fails:
                skipped.append(Skipped(node, "model",
                                       "model files missing or different: name it in --checks "
                                       "model to copy them from the reference node"))
    return FixPlan(tuple(steps), tuple(manual), tuple(skipped), tuple(ok))


def _model_results(results: Sequence[CheckResult]) -> dict[str, CheckResult]:
    """Per node, the first failing `model` (absent, no config.json) or `model-match` result."""
    out: dict[str, CheckResult] = {}
    for r in results:
        if r.node and r.check in ("model", "model-match") and _needs_fix(r) \
                and r.status is not Status.ERROR:
            out.setdefault(r.node, r)
    return out


def plan_model(fails: Mapping[str, CheckResult], facts: Mapping[str, NodeFactsSummary],
               inventory: Inventory) -> list[Step | Manual]:
    """One copy step per failing node, all from the reference: of the nodes that passed, the one
    whose key files most nodes share (the head on a tie)."""
    prints = {name: f.model_print() for name, f in facts.items()
              if name not in fails and "config.json" in (f.model_files or {})}
    source = reference_node(prints, inventory.head.name, [n.name for n in inventory.nodes])
    path = inventory.model_path
    if source is None or not path:
        return [Manual(node, "model", f"no node among those checked has a good copy: {r.summary}",
                       "copy the model to one node by hand (or include a node that has it "
                       "in --nodes), then run `cluster fix --checks model` again")
                for node, r in fails.items()]
    return [Step(node, "model", f"copy the missing or differing files of {path} from {source}",
                 note="undo does not restore model files (the undo record lists their paths)",
                 source=source)
            for node in fails]


def as_root(command: str, node: Node, inventory: Inventory, local_root: bool) -> str:
    """The command as root: as it is for root, else through `sudo -n` (never a password)."""
    user = node.user or inventory.ssh.user
    if (node.local and local_root) or user == "root" or (user is None and local_root):
        return command
    return as_root_command(command)
