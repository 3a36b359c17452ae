"""paramiko's and Fabric's private parts, in one place: everything cluster/nodes/remote.py needs
from them beyond their public API (tests/test_ssh_adapter.py pins each behaviour relied on, by
name, so an upgrade that changes one fails there first; tests/test_public_interfaces.py fails on
a private paramiko or Fabric use anywhere else).

Relied on, each for a cost measured at rack scale (each function says which):
    paramiko.HostKeys._entries, ._hostname_matches   indexed_host_keys: O(1) lookups by name
    paramiko.SSHClient._host_keys, ._system_host_keys share_host_keys: one parsed known_hosts
    paramiko.Transport._active_check_timeout          quiet_transport_class: 1 wake-up a second
    paramiko.Transport._parse_debug                   quiet_transport_class: SSH_MSG_DEBUG unparsed
    fabric.Connection.__init__ writes inline_ssh_env  shared_config_connection: the shared Config
                                                      is never written
"""

from __future__ import annotations

import logging
import threading

# A node whose sshd answered (TCP accepted, banner read within connect_timeout) is there: its key
# exchange may still be slow when its CPUs are saturated. A Ray head whose GCS was killed has its
# dashboard processes spin on 2 cores; the handshake took 1.3 s on the simulated cluster here and
# more than 5 s in CI, where a 5 s connect_timeout then called the head unreachable.
HANDSHAKE_TIMEOUT_FACTOR = 3
HANDSHAKE_UNFINISHED = "SSH key exchange not finished"


def share_host_keys(client, known, system) -> None:
    """Make an SSHClient check against these (already loaded) HostKeys: paramiko has no public
    setter, and load_host_keys() would parse the file again for every connection."""
    client._host_keys, client._system_host_keys = known, system


_INDEXED = None


def indexed_host_keys():
    """A paramiko HostKeys whose lookup by name goes through an index.

    paramiko's lookup() compares the name with every known_hosts entry, and every connection
    looks up its host a few times: at rack scale O(nodes) per connect, O(nodes^2) in all (and
    load() checks each new line the same way). Here lookup() reads the entries that name the
    host exactly (from an index kept up to date with the entries) plus the hashed (|1|) entries,
    each checked as paramiko checks it, and answers what paramiko's lookup would: the matching
    entries in file order, as a read-only mapping of key type -> key (the first entry of a type
    wins, as in paramiko's). Changes go through add(), load() or the entries list, never through
    a lookup's answer. Thread-safe: every node's connection reads the one shared instance.
    """
    global _INDEXED
    if _INDEXED is None:
        from collections.abc import Mapping

        import paramiko

        class FoundKeys(Mapping):
            """A lookup's answer, read-only, read as paramiko's: [key] the first matching
            entry's key of that type; keys() a list, one type per matching entry in file
            order (SSHClient reads `keys()[0]`)."""

            def __init__(self, found: list):
                self._types = [key.get_name() for key in found]
                self._keys: dict = {}
                for key in found:
                    self._keys.setdefault(key.get_name(), key)

            def __getitem__(self, keytype):
                return self._keys[keytype]

            def __iter__(self):
                return iter(self.keys())

            def __len__(self):
                return len(self._types)

            def keys(self):
                return list(self._types)

        class IndexedHostKeys(paramiko.HostKeys):
            def __init__(self, filename=None):
                self._index_lock = threading.RLock()
                self._indexed: list = []      # the entries list the index was built from
                self._count = 0               # how many of its entries are indexed
                self._by_name: dict[str, list[int]] = {}
                self._hashed: list[int] = []  # positions of entries with a hashed name
                super().__init__(filename)

            def _index(self) -> None:
                entries = self._entries
                if entries is not self._indexed or len(entries) < self._count:
                    self._indexed, self._count = entries, 0
                    self._by_name, self._hashed = {}, []
                for pos in range(self._count, len(entries)):
                    names = entries[pos].hostnames
                    for name in set(names):
                        self._by_name.setdefault(name, []).append(pos)
                    if any(name.startswith("|1|") for name in names):
                        self._hashed.append(pos)
                self._count = len(entries)

            def lookup(self, hostname):
                with self._index_lock:
                    self._index()
                    entries = self._entries
                    found = set(self._by_name.get(hostname, ()))
                    if not hostname.startswith("|1|"):
                        found.update(pos for pos in self._hashed
                                     if self._hostname_matches(hostname, entries[pos]))
                    keys = [entries[pos].key for pos in sorted(found)]
                if not found:
                    return None
                return FoundKeys([key for key in keys if key is not None])

            def add(self, hostname, keytype, key):
                with self._index_lock:
                    self._index()
                    for pos in self._by_name.get(hostname, ()):
                        entry = self._entries[pos]
                        if entry.key is not None and entry.key.get_name() == keytype:
                            entry.key = key
                            return
                    self._entries.append(paramiko.hostkeys.HostKeyEntry([hostname], key))

            def load(self, filename):
                with self._index_lock:
                    super().load(filename)

            def clear(self):
                with self._index_lock:
                    super().clear()

            def __delitem__(self, key):
                with self._index_lock:
                    super().__delitem__(key)
                    self._indexed = []        # positions moved: index again

        _INDEXED = IndexedHostKeys
    return _INDEXED()


_SHARED_CONFIG = None


def shared_config_connection():
    """Fabric's Connection that never writes into the Config it is given.

    invoke treats an attribute it does not see on the class as a config key: Fabric 3's
    Connection.__init__ sets `self.inline_ssh_env`, which is not declared on the class, so every
    new connection wrote into the run's one shared Config, and that write re-merges the whole
    config (its dict emptied, then refilled) while other nodes' threads read `config.run`:
    now and then a node failed with "No attribute or config key found for 'run'" (seen at 128
    nodes). Declared here, it is the connection's own attribute, as Fabric does for the rest.
    """
    global _SHARED_CONFIG
    if _SHARED_CONFIG is None:
        from fabric import Connection

        class SharedConfigConnection(Connection):
            inline_ssh_env = None

        _SHARED_CONFIG = SharedConfigConnection
    return _SHARED_CONFIG


_QUIET = None


def quiet_transport_class():
    """paramiko's Transport, its reader thread waking once a second instead of ten times.

    The thread's socket timeout only exists to notice a closed transport (close() stops it at
    once anyway); at rack scale 10 wake-ups a second on every open connection, through a
    bastion twice over, were a large share of the laptop's CPU for a slow run.
    """
    global _QUIET
    if _QUIET is None:
        import paramiko

        class QuietTransport(paramiko.Transport):
            _active_check_timeout = 1.0

            def start_client(self, event=None, timeout=None):
                # the banner keeps its own timeout (banner_timeout: a hung sshd is named within
                # connect_timeout); the key exchange after it gets HANDSHAKE_TIMEOUT_FACTOR x
                handshake_s = None if timeout is None else timeout * HANDSHAKE_TIMEOUT_FACTOR
                super().start_client(event=event, timeout=handshake_s)
                if event is None and handshake_s is not None and self.is_active() \
                        and not self.initial_kex_done:
                    # paramiko returns here as if it had succeeded; its next step would then
                    # fail with "No existing session", which names nothing
                    self.close()
                    raise paramiko.SSHException(
                        f"{HANDSHAKE_UNFINISHED} within {handshake_s:g} s (the node's sshd "
                        "answered: it may be overloaded)")

            def _parse_debug(self, m):
                # a server's SSH_MSG_DEBUG (sshd sends one per authorized_keys option) is only
                # logged, after an escape loop run byte by byte in Python: skip it unless logged
                if self.logger.isEnabledFor(logging.DEBUG):
                    super()._parse_debug(m)
                else:
                    m.get_boolean(), m.get_string(), m.get_string()

        _QUIET = QuietTransport
    return _QUIET
