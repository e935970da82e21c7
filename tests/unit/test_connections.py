"""service/connections.py without a server: the /proc tables read, the newest connections of a peer over its cap
chosen, and the open-file limit raised to fit --max-connections (or a warning). Through a server:
tests/integration/test_connections.py."""

from __future__ import annotations

import logging
import resource

from tokenloop.service.connections import FD_HEADROOM, Conn, check_fd_limit, established, over_cap

TABLE = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:C350 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 100 1 0 100 0 0 10 0
   1: 0100007F:C350 0200007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 205 1 0 20 4 30 10 -1
   2: 0100007F:C350 0200007F:9C41 01 00000000:00000000 00:00000000 00000000     0        0 201 1 0 20 4 30 10 -1
   3: 0100007F:9C42 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 300 1 0 20 4 30 10 -1
   4: 0100007F:C350 0100007F:9C43 06 00000000:00000000 00:00000000 00000000     0        0 0 3 0 0 0 0 0 0
"""
TABLE6 = """  sl  local_address                         remote_address                        st ...
   0: 0000000000000000FFFF00000100007F:C350 0000000000000000FFFF00000300007F:9C44 01 00000000:00000000 00:00000000 00000000 0 0 207 1
   1: 00000000000000000000000001000000:C350 00000000000000000000000001000000:9C45 01 00000000:00000000 00:00000000 00000000 0 0 208 1
"""


def test_established_connections_to_the_port_by_peer(tmp_path):
    (tmp_path / "tcp").write_text(TABLE)
    (tmp_path / "tcp6").write_text(TABLE6)
    conns = established(0xC350, (str(tmp_path / "tcp"), str(tmp_path / "tcp6"), str(tmp_path / "missing")))
    # the listener (0A), a client socket of this process (local port 40002) and a TIME_WAIT (06) are not counted
    assert conns == [Conn("127.0.0.2", 205), Conn("127.0.0.2", 201), Conn("127.0.0.3", 207), Conn("::1", 208)]


def test_the_newest_connections_of_a_peer_over_its_cap():
    conns = [Conn("a", 5), Conn("a", 1), Conn("b", 2), Conn("a", 9), Conn("a", 3)]
    assert over_cap(conns, 2) == [Conn("a", 5), Conn("a", 9)]
    assert over_cap(conns, 4) == []
    assert over_cap(conns, 0, 3) == [Conn("a", 5), Conn("a", 9)]  # the newest beyond the total
    assert over_cap(conns, 2, 2) == [Conn("a", 5), Conn("a", 9), Conn("a", 3)]  # per peer first, then the total


def test_over_cap_orders_by_the_look_that_first_saw_a_connection():
    """Inodes come from per-CPU batches, so a later socket can have a lower inode: age is the look that first saw a
    connection, the inode only within one look, and a connection no look has seen yet is the newest."""
    conns = [Conn("a", 900), Conn("a", 5), Conn("a", 7), Conn("a", 3)]
    seen = {900: 1, 5: 2, 7: 2}
    assert over_cap(conns, 2, 0, seen) == [Conn("a", 7), Conn("a", 3)]
    assert over_cap(conns, 0, 1, seen) == [Conn("a", 5), Conn("a", 7), Conn("a", 3)]


def test_the_open_file_limit_is_raised_to_fit_the_cap_or_a_warning_says_why_not(caplog):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
        assert check_fd_limit(1000) is None
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 1000 + FD_HEADROOM
        if hard != resource.RLIM_INFINITY:
            with caplog.at_level(logging.WARNING, logger="tokenloop.connections"):
                warning = check_fd_limit(hard)  # hard + headroom cannot fit
            assert warning is not None and "lower --max-connections" in warning
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
