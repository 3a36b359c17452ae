"""The pins of cluster/nodes/ssh_adapter.py (issue 40 item 3): each private part of paramiko or
Fabric the adapter relies on, checked by name against the installed version, so an upgrade that
moves one fails here first, saying which, before any connection misbehaves."""

from __future__ import annotations

import inspect

import paramiko
import pytest
from fabric import Config, Connection

from cluster.nodes import ssh_adapter


@pytest.fixture(scope="module")
def key():
    return paramiko.ECDSAKey.generate()


def test_pin_paramiko_hostkeys_keeps_its_entries_in_a_list_it_appends_to(key):
    """indexed_host_keys indexes HostKeys._entries (HostKeyEntry, file order)."""
    keys = paramiko.HostKeys()
    keys.add("node1", key.get_name(), key)
    assert isinstance(keys._entries, list)
    (entry,) = keys._entries
    assert isinstance(entry, paramiko.hostkeys.HostKeyEntry)
    assert (entry.hostnames, entry.key) == (["node1"], key)


def test_pin_paramiko_hostkeys_hostname_matches_checks_a_hashed_entry(key):
    """indexed_host_keys checks hashed (|1|) entries with HostKeys._hostname_matches."""
    keys = paramiko.HostKeys()
    entry = paramiko.hostkeys.HostKeyEntry([paramiko.HostKeys.hash_host("node1")], key)
    assert keys._hostname_matches("node1", entry)
    assert not keys._hostname_matches("node2", entry)


def test_pin_paramiko_sshclient_checks_against_its_host_keys_attributes(key):
    """share_host_keys sets SSHClient._host_keys / ._system_host_keys: the tables the client
    checks a server's key against (get_host_keys() is the first)."""
    client = paramiko.SSHClient()
    assert isinstance(client._host_keys, paramiko.HostKeys)
    assert isinstance(client._system_host_keys, paramiko.HostKeys)
    known, system = ssh_adapter.indexed_host_keys(), ssh_adapter.indexed_host_keys()
    ssh_adapter.share_host_keys(client, known, system)
    assert client.get_host_keys() is known
    source = inspect.getsource(paramiko.SSHClient.connect)
    assert "self._system_host_keys" in source and "self._host_keys" in source


def test_pin_paramiko_transport_reads_active_check_timeout_as_its_socket_timeout():
    """quiet_transport_class sets Transport._active_check_timeout: the reader's socket timeout."""
    assert isinstance(paramiko.Transport._active_check_timeout, (int, float))
    assert "self.sock.settimeout(self._active_check_timeout)" in \
        inspect.getsource(paramiko.Transport)
    assert ssh_adapter.quiet_transport_class()._active_check_timeout == 1.0


def test_pin_paramiko_transport_handles_ssh_msg_debug_in_parse_debug():
    """quiet_transport_class overrides Transport._parse_debug(m), which reads a bool and two
    strings (SSH_MSG_DEBUG)."""
    source = inspect.getsource(paramiko.Transport)
    assert "self._parse_debug(m)" in source
    assert list(inspect.signature(paramiko.Transport._parse_debug).parameters) == ["self", "m"]
    body = inspect.getsource(paramiko.Transport._parse_debug)
    assert "m.get_boolean()" in body and body.count("m.get_string()") == 2


def test_pin_fabric_connection_writes_inline_ssh_env_into_its_config_unless_declared():
    """shared_config_connection declares inline_ssh_env on the class: Fabric's Connection sets
    it in __init__, and invoke writes an undeclared attribute into the (shared) Config."""
    config = Config(lazy=True)
    before = config.inline_ssh_env
    Connection("h", config=config, gateway=False, inline_ssh_env=not before)
    assert config.inline_ssh_env == (not before), "Fabric no longer writes into the Config"
    shared = Config(lazy=True)
    ssh_adapter.shared_config_connection()("h", config=shared, gateway=False,
                                           inline_ssh_env=not before)
    assert shared.inline_ssh_env == before
